package main

import (
	"context"
	"crypto/tls"
	"flag"
	"fmt"
	"log"
	"net"
	"os"

	"github.com/ktlsingress/caddy-ktls/ktls"
	"github.com/ktlsingress/caddy-ktls/splice"
)

// runFloor is the floor-ktls and floor-plain subcommands: the least a
// forwarder can do. floor-ktls accepts TLS 1.3, installs TLS_TX and TLS_RX
// with package ktls (no fallback) and splices to the upstream with package
// splice; floor-plain splices plain TCP. No preamble, no policy, no Caddy:
// what the ktls contender costs above floor-ktls is this project's overhead.
func runFloor(name string, args []string) error {
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	listen := fs.String("listen", "127.0.0.1:0", "address to accept on")
	upstream := fs.String("upstream", "", "upstream address")
	certFile := fs.String("cert", "", "server certificate (floor-ktls)")
	keyFile := fs.String("key", "", "server key (floor-ktls)")
	fs.Parse(args)
	var cfg *tls.Config
	if name == "floor-ktls" {
		cert, err := tls.LoadX509KeyPair(*certFile, *keyFile)
		if err != nil {
			return err
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}
	}
	ln, err := net.Listen("tcp", *listen)
	if err != nil {
		return err
	}
	fmt.Fprintf(os.Stderr, "%s: listening on %s\n", name, ln.Addr())
	for {
		c, err := ln.Accept()
		if err != nil {
			return err
		}
		go func() {
			if err := floorTunnel(c, cfg, *upstream); err != nil {
				log.Printf("%s: %v", name, err)
			}
		}()
	}
}

func floorTunnel(c net.Conn, cfg *tls.Config, upstream string) error {
	if cfg != nil {
		kc := ktls.Server(c, cfg, ktls.Options{RequireOffload: true})
		if err := kc.Handshake(); err != nil {
			kc.Close()
			return err
		}
		c = kc
	}
	up, err := net.Dial("tcp", upstream)
	if err != nil {
		c.Close()
		return err
	}
	_, err = splice.Run(context.Background(), c, up, splice.Options{})
	return err
}
