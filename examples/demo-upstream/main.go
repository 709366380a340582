// Command demo-upstream is the sandbox service of the caddy-ktls demo: a TCP
// echo server. It sends back every byte it receives, half-closes when the
// client half-closes, and logs how many bytes each connection carried.
package main

import (
	"flag"
	"io"
	"log"
	"net"
)

func main() {
	addr := flag.String("listen", "127.0.0.1:9000", "address to listen on")
	flag.Parse()
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
