package main

import (
	"bytes"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
	"strconv"
	"sync/atomic"
)

// upstream is the one target every contender forwards to, in the driver's
// process (its CPU is not the forwarder's): raw speaks the header protocol of
// wire.go for the L4 contenders, web the same shapes over HTTP/1.1 for
// reverse_proxy.
type upstream struct {
	raw, web net.Listener
	srv      *http.Server
	// conns counts the connections accepted on either listener: for an
	// edge-gateway chain, one per tunnel its forwarder opened (the
	// sandbox handler dials the target once per tunnel), which is how
	// many key installs tls_stat must show.
	conns atomic.Int64
}

// countingListener counts the connections it accepts.
type countingListener struct {
	net.Listener
	n *atomic.Int64
}

func (l countingListener) Accept() (net.Conn, error) {
	c, err := l.Listener.Accept()
	if err == nil {
		l.n.Add(1)
	}
	return c, err
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
	go u.srv.Serve(countingListener{web, &u.conns})
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
		u.conns.Add(1)
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
		// Everything up to EOF counts: the gateway compares the count with
		// what it sent, so a byte appended after its n fails.
		sum := sha256.New()
		got, err := io.CopyBuffer(sum, c, make([]byte, 256<<10))
		if err != nil {
			return fmt.Errorf("upload: %w after %d bytes", err, got)
		}
		reply := uploadReply{n: uint64(got)}
		sum.Sum(reply.sum[:0])
		_, err = c.Write(reply.marshal())
		return err
	case opDownload:
		_, err := newPayload(h.seed, int64(h.n)).WriteTo(c)
		return err
	case opSmall:
		got, req, resp := make([]byte, h.req), make([]byte, h.req), make([]byte, h.resp)
		for i := range h.n {
			if _, err := io.ReadFull(c, got); err != nil {
				return fmt.Errorf("small call %d: %w", i, err)
			}
			callBytes(req, resp, h.seed, i)
			if !bytes.Equal(got, req) {
				return fmt.Errorf("small call %d: request bytes differ from the payload", i)
			}
			if _, err := c.Write(resp); err != nil {
				return err
			}
		}
		// The gateway half-closes after its last call: a byte before EOF is
		// not its, and the answer tells it so.
		extra, err := io.Copy(io.Discard, c)
		if extra > 0 {
			fmt.Fprintf(c, "upstream: %d bytes after the last call", extra)
			return fmt.Errorf("small calls: %d bytes after the last call, want EOF", extra)
		}
		return err
	case opLoad:
		if h.req == 0 {
			return errors.New("load calls need a request of a byte at least")
		}
		got, req, resp := make([]byte, h.req), make([]byte, h.req), make([]byte, h.resp)
		for i := uint64(0); ; i++ {
			if _, err := io.ReadFull(c, got); err == io.EOF {
				return nil // the gateway's end, between two calls
			} else if err != nil {
				return fmt.Errorf("load call %d: %w", i, err)
			}
			callBytes(req, resp, h.seed, i)
			if !bytes.Equal(got, req) {
				return fmt.Errorf("load call %d: request bytes differ from the payload", i)
			}
			if _, err := c.Write(resp); err != nil {
				return err
			}
		}
	}
	return fmt.Errorf("unknown op %q", h.op)
}

// serveUpload answers the body's length and SHA-256, "<bytes> <hex>".
func serveUpload(w http.ResponseWriter, r *http.Request) {
	sum := sha256.New()
	n, err := io.CopyBuffer(sum, r.Body, make([]byte, 256<<10))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	fmt.Fprintf(w, "%d %x", n, sum.Sum(nil))
}

func serveDownload(w http.ResponseWriter, r *http.Request) {
	n, err := strconv.ParseInt(r.URL.Query().Get("n"), 10, 64)
	if err != nil || n < 0 {
		http.Error(w, "bad n", http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.FormatInt(n, 10))
	newPayload(bulkSeed, n).WriteTo(w)
}

// serveCall answers call i of stream seed with sizes req and resp (query
// seed, i, req, resp): the body must be the call's request.
func serveCall(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	reqLen, err1 := strconv.Atoi(q.Get("req"))
	resp, err2 := strconv.Atoi(q.Get("resp"))
	seed, err3 := strconv.ParseUint(q.Get("seed"), 10, 32)
	i, err4 := strconv.ParseUint(q.Get("i"), 10, 64)
	if err := errors.Join(err1, err2, err3, err4); err != nil || reqLen < 0 || reqLen > maxCallLen || resp < 0 || resp > maxCallLen {
		http.Error(w, fmt.Sprintf("query %q: want seed, i, and req and resp in [0, %d]", r.URL.RawQuery, maxCallLen), http.StatusBadRequest)
		return
	}
	got, err := io.ReadAll(io.LimitReader(r.Body, maxCallLen+1))
	if err != nil {
		http.Error(w, err.Error(), http.StatusBadRequest)
		return
	}
	req, out := make([]byte, reqLen), make([]byte, resp)
	callBytes(req, out, uint32(seed), i)
	if !bytes.Equal(got, req) {
		http.Error(w, fmt.Sprintf("request: %d bytes that differ from call %d's %d", len(got), i, reqLen), http.StatusBadRequest)
		return
	}
	w.Header().Set("Content-Length", strconv.Itoa(resp))
	w.Write(out)
}
