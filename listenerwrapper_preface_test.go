package caddyktls

import (
	"errors"
	"io"
	"os"
	"strings"
	"testing"

	"golang.org/x/net/http2"
)

// chunkReader returns its chunks one per Read, then err (io.EOF when nil);
// a chunk "!timeout" is a read that timed out.
type chunkReader struct {
	chunks []string
	err    error
}

func (r *chunkReader) Read(p []byte) (int, error) {
	if len(r.chunks) == 0 {
		if r.err != nil {
			return 0, r.err
		}
		return 0, io.EOF
	}
	c := r.chunks[0]
	if c == "!timeout" {
		r.chunks = r.chunks[1:]
		return 0, os.ErrDeadlineExceeded
	}
	n := copy(p, c)
	if n == len(c) {
		r.chunks = r.chunks[1:]
	} else {
		r.chunks[0] = c[n:]
	}
	return n, nil
}

func TestPrefaceGate(t *testing.T) {
	pre := http2.ClientPreface
	for _, tc := range []struct {
		name   string
		h2     bool
		chunks []string
		want   string // everything read, or "EOF" for a closed connection
	}{
		{"h2, preface and frames", true, []string{pre + "frames"}, pre + "frames"},
		{"h2, preface a byte at a time", true, strings.Split(pre+"x", ""), pre + "x"},
		{"h2, preface after a timeout", true, []string{pre[:5], "!timeout", pre[5:]}, pre},
		{"h2, HTTP/1.1 request", true, []string{"GET / HTTP/1.1\r\n\r\n"}, "EOF"},
		{"h2, preface wrong in its last byte", true, []string{pre[:23] + "X"}, "EOF"},
		{"h2, preface cut short", true, []string{pre[:10]}, "EOF"},
		{"h2, nothing", true, nil, "EOF"},
		{"http/1.1, request", false, []string{"GET / HTTP/1.1\r\n\r\n"}, "GET / HTTP/1.1\r\n\r\n"},
		{"http/1.1, PRI request that is not the preface", false, []string{pre[:18] + "XX\r\n\r\n"}, pre[:18] + "XX\r\n\r\n"},
		{"http/1.1, the preface", false, []string{pre + "frames"}, "EOF"},
		{"http/1.1, the preface in pieces", false, []string{pre[:3], pre[3:14], pre[14:]}, "EOF"},
		{"http/1.1, a prefix of the preface, then the end", false, []string{pre[:14]}, pre[:14]},
	} {
		t.Run(tc.name, func(t *testing.T) {
			g := &prefaceGate{h2: tc.h2}
			r := &chunkReader{chunks: tc.chunks}
			var got strings.Builder
			buf := make([]byte, 5) // smaller than the preface: head is returned in pieces
			for range 100 {
				n, err := g.read(r, buf)
				got.Write(buf[:n])
				if errors.Is(err, os.ErrDeadlineExceeded) {
					continue
				}
				if err == io.EOF {
					break
				}
				if err != nil {
					t.Fatal(err)
				}
			}
			if tc.want == "EOF" {
				if got.Len() != 0 || !g.closed {
					t.Fatalf("read %q, closed %v: want the connection closed before any byte", got.String(), g.closed)
				}
				return
			}
			if got.String() != tc.want {
				t.Fatalf("read %q, want %q", got.String(), tc.want)
			}
		})
	}
}
