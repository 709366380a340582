package main

import (
	"bytes"
	"crypto/sha256"
	"encoding/hex"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
)

// upstream is the one target every contender forwards to, in the driver's
// process (its CPU is not the forwarder's): raw speaks the header protocol of
// wire.go for the L4 contenders, web the same shapes over HTTP/1.1 for
// reverse_proxy.
type upstream struct {
	raw, web net.Listener
	srv      *http.Server
}

func startUpstream() (*upstream, error) {
	raw, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return nil, err
	}
	web, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		raw.Close()
		return nil, err
	}
	u := &upstream{raw: raw, web: web}
	mux := http.NewServeMux()
	mux.HandleFunc("POST /upload", serveUpload)
	mux.HandleFunc("GET /download", serveDownload)
	mux.HandleFunc("POST /call", serveCall)
	u.srv = &http.Server{Handler: mux, ErrorLog: log.New(io.Discard, "", 0)}
	go u.srv.Serve(web)
	go u.acceptRaw()
	return u, nil
}

func (u *upstream) rawAddr() string { return u.raw.Addr().String() }
func (u *upstream) webAddr() string { return u.web.Addr().String() }

func (u *upstream) close() {
	u.raw.Close()
	u.srv.Close()
}

func (u *upstream) acceptRaw() {
	for {
		c, err := u.raw.Accept()
		if err != nil {
			return
		}
		go func() {
			defer c.Close()
			if err := serveRaw(c); err != nil {
				log.Printf("upstream: %v", err)
			}
		}()
	}
}

// serveRaw runs one connection of the header protocol. A request that does
// not match the payload closes the connection, which the gateway reports as a
// short read.
func serveRaw(c net.Conn) error {
	h, err := readHeader(c)
	if err == io.EOF {
		return nil // the driver's readiness probe of a plain-TCP contender
	}
	if err != nil {
		return fmt.Errorf("header: %w", err)
	}
	switch h.op {
	case opUpload:
		sum := sha256.New()
		if _, err := io.CopyBuffer(sum, io.LimitReader(c, int64(h.n)), make([]byte, 256<<10)); err != nil {
			return fmt.Errorf("upload: %w", err)
		}
		_, err = c.Write(sum.Sum(nil))
		return err
	case opDownload:
		_, err := newPayload(int64(h.n)).WriteTo(c)
		return err
	case opSmall:
		req := make([]byte, h.req)
		for range h.n {
			if _, err := io.ReadFull(c, req); err != nil {
				return fmt.Errorf("small call: %w", err)
			}
			if !bytes.Equal(req, block[:h.req]) {
				return fmt.Errorf("small call: request bytes differ from the payload")
			}
			if _, err := c.Write(block[:h.resp]); err != nil {
				return err
			}
		}
		return nil
	}
	return fmt.Errorf("unknown op %q", h.op)
}

func serveUpload(w http.ResponseWriter, r *http.Request) {
	sum := sha256.New()
	if _, err := io.CopyBuffer(sum, r.Body, make([]byte, 256<<10)); err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	io.WriteString(w, hex.EncodeToString(sum.Sum(nil)))
}

func serveDownload(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
	if err != nil || n < 0 {
		http.Error(w, "bad n", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	newPayload(n).WriteTo(w)
}

func serveCall(w http.ResponseWriter, r *http.Request) {
	resp, err := strconv.Atoi(r.URL.Query().Get("resp"))
	if err != nil || resp < 0 || resp > blockLen {
		http.Error(w, "bad resp", http.StatusBadRequest)
		return
	}
	req, err := io.ReadAll(io.LimitReader(r.Body, blockLen+1))
	if err != nil || !bytes.Equal(req, block[:len(req)]) {
		http.Error(w, "request bytes differ from the payload", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(resp))
	w.Write(block[:resp])
}
