// Command demo-upstream is the sandbox service of the caddy-ktls demo: a TCP
// server that answers every connection with "sandbox says: " followed by
// everything the client sent, upper-cased, and closes when the client
// half-closes.
package main

import (
	"bufio"
	"bytes"
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
		go serve(c)
	}
}

func serve(c net.Conn) {
	defer c.Close()
	in, err := io.ReadAll(bufio.NewReader(c))
	if err != nil {
		log.Printf("%s: %v", c.RemoteAddr(), err)
		return
	}
	c.Write(append([]byte("sandbox says: "), bytes.ToUpper(in)...))
	log.Printf("%s: answered %d bytes", c.RemoteAddr(), len(in))
}
