// Command demo-upstream is the sandbox service of the caddy-ktls demo: a TCP
// echo server. It sends back every byte it receives, half-closes when the
// client half-closes, and logs how many bytes each connection carried.
// With -http it also serves the sandbox's HTTP app (HTTP/1.1 and h2c):
// GET /hello greets with the Host and protocol it was reached with, POST
// /echo answers the request body.
package main

import (
	"flag"
	"fmt"
	"io"
	"log"
	"net"
	"net/http"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:9000", "address to listen on")
	httpAddr := flag.String("http", "", "address of the HTTP app (HTTP/1.1 and h2c); none when empty")
	flag.Parse()
	if *httpAddr != "" {
		go serveHTTP(*httpAddr)
	}
	ln, err := net.Listen("tcp", *addr)
	if err != nil {
		log.Fatal(err)
	}
	log.Printf("demo upstream listening on %s", ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			log.Fatal(err)
		}
		go echo(c.(*net.TCPConn))
	}
}

func echo(c *net.TCPConn) {
	defer c.Close()
	n, err := io.Copy(c, c)
	if err != nil {
		log.Printf("%s: echoed %d bytes: %v", c.RemoteAddr(), n, err)
		return
	}
	c.CloseWrite()
	log.Printf("%s: echoed %d bytes", c.RemoteAddr(), n)
}

func serveHTTP(addr string) {
	mux := http.NewServeMux()
	mux.HandleFunc("GET /hello", func(w http.ResponseWriter, r *http.Request) {
		fmt.Fprintf(w, "hello from the sandbox app: %s over %s\n", r.Host, r.Proto)
	})
	mux.HandleFunc("POST /echo", func(w http.ResponseWriter, r *http.Request) {
		n, err := io.Copy(w, r.Body)
		log.Printf("http %s: echoed %d bytes (%v)", r.RemoteAddr, n, err)
	})
	srv := &http.Server{Addr: addr, Handler: mux, Protocols: new(http.Protocols)}
	srv.Protocols.SetHTTP1(true)
	srv.Protocols.SetUnencryptedHTTP2(true)
	log.Printf("demo HTTP app listening on %s", addr)
	log.Fatal(srv.ListenAndServe())
}
