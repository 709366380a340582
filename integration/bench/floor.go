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
	a := parseFloorArgs(name, args)
	var cfg *tls.Config
	if name == "floor-ktls" {
		cert, err := tls.LoadX509KeyPair(a.certFile, a.keyFile)
		if err != nil {
			return err
		}
		cfg = &tls.Config{Certificates: []tls.Certificate{cert}, MinVersion: tls.VersionTLS13}
	}
	return serveFloor(name, a.listen, func(c net.Conn) error { return floorTunnel(c, cfg, a.upstream) })
}

// floorArgs are the flags of every floor subcommand.
type floorArgs struct{ listen, upstream, certFile, keyFile string }

func parseFloorArgs(name string, args []string) floorArgs {
	var a floorArgs
	fs := flag.NewFlagSet(name, flag.ExitOnError)
	fs.StringVar(&a.listen, "listen", "127.0.0.1:0", "address to accept on")
	fs.StringVar(&a.upstream, "upstream", "", "upstream address")
	fs.StringVar(&a.certFile, "cert", "", "server certificate (TLS floors)")
	fs.StringVar(&a.keyFile, "key", "", "server key (TLS floors)")
	fs.Parse(args)
	return a
}

// serveFloor accepts on listen and runs tunnel for each connection.
func serveFloor(name, listen string, tunnel func(net.Conn) error) error {
	ln, err := net.Listen("tcp", listen)
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
			if err := tunnel(c); err != nil {
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
