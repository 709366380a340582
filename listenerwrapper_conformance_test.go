package caddyktls

import (
	"bytes"
	"crypto/tls"
	"encoding/json"
	"encoding/xml"
	"errors"
	"fmt"
	"io"
	"maps"
	"net"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/caddyserver/caddy/v2"
	"golang.org/x/net/http2"
	"golang.org/x/net/http2/hpack"

	"github.com/ktlsingress/caddy-ktls/internal/kerneltest"
	"github.com/ktlsingress/caddy-ktls/internal/sockerr"
	"github.com/ktlsingress/caddy-ktls/internal/testpki"
	"github.com/ktlsingress/caddy-ktls/ktls"
)

// Conformance: the ktls listener wrapper must not change what an HTTP client
// sees. Stock Caddy and Caddy with the wrapper serve the same routes with
// the same TLS from one process, for each protocol set a server can have;
// every scripted HTTP/1.1 and HTTP/2 case and every h2spec case must end
// the same way on both (same bytes but the Date header, same end of the
// connection).

// TestListenerWrapperConformance compares the two on userspace TLS.
func TestListenerWrapperConformance(t *testing.T) {
	if kerneltest.Available() == nil {
		t.Skip("kTLS is available here: TestKernelListenerWrapperConformance covers this kernel")
	}
	confRun(t, false)
}

// TestKernelListenerWrapperConformance compares the two on a kTLS kernel,
// where the wrapper's connections are offloaded.
func TestKernelListenerWrapperConformance(t *testing.T) {
	kerneltest.Require(t)
	confRun(t, true)
}

// confProtocols are the protocol sets compared: Caddy's default without
// HTTP/3 (whose UDP listener neither side changes), and each alone, where
// Caddy checks the HTTP/2 preface itself.
var confProtocols = [][]string{{"h1", "h2"}, {"h1"}, {"h2"}}

func confRun(t *testing.T, kernel bool) {
	site := confStart(t)
	offloaded := ktls.Stats().Outcomes[ktls.ReasonNone]
	// h2spec mostly waits (h2specDelay per request): every server's run
	// starts here, side by side, and the cases run meanwhile. The protocol
	// sets run side by side too; the group returns when all have ended.
	h2spec := map[string]*h2specProcess{}
	for i, protos := range confProtocols {
		if slices.Contains(protos, "h2") {
			for _, addr := range site.addrs[2*i : 2*i+2] {
				h2spec[addr] = h2specStart(t, addr)
			}
		}
	}
	t.Run("sets", func(t *testing.T) {
		for i, protos := range confProtocols {
			stock, wrapped := site.addrs[2*i], site.addrs[2*i+1]
			t.Run(strings.Join(protos, "+"), func(t *testing.T) {
				t.Parallel()
				confSet(t, site, protos, stock, wrapped, h2spec)
			})
		}
	})
	if kernel && ktls.Stats().Outcomes[ktls.ReasonNone] == offloaded {
		t.Error("no connection of the wrapper was offloaded")
	}
}

// confSet compares one protocol set's stock and wrapped servers case by
// case, and by their h2spec runs where the set has h2.
func confSet(t *testing.T, site *confSite, protos []string, stock, wrapped string, h2spec map[string]*h2specProcess) {
	for _, c := range confCases {
		t.Run(c.name, func(t *testing.T) {
			t.Parallel()
			want := c.run(t, site, stock)
			got := c.run(t, site, wrapped)
			if c.refusedEitherWay {
				want, got = refusedOutcome(want), refusedOutcome(got)
			}
			if c.pri && strings.Contains(want, "HTTP/2.0 PRI *") {
				// The one documented difference (prefaceGate).
				want = want[:strings.IndexByte(want, '\n')+1]
			}
			if got != want {
				t.Errorf("the wrapper differs from stock Caddy\n--- stock Caddy:\n%s\n--- with ktls:\n%s", want, got)
			}
		})
	}
	if slices.Contains(protos, "h2") {
		t.Run("h2spec", func(t *testing.T) {
			t.Parallel()
			confH2Spec(t, site, h2spec[stock], h2spec[wrapped])
		})
	}
}

// confSite is one Caddy with a stock and a wrapped HTTPS server per
// protocol set (addrs: stock, wrapped, stock, wrapped, ...).
type confSite struct {
	ca    *testpki.CA
	addrs []string
}

func confStart(t *testing.T) *confSite {
	t.Helper()
	dir := t.TempDir()
	t.Setenv("XDG_DATA_HOME", filepath.Join(dir, "data"))
	t.Setenv("XDG_CONFIG_HOME", filepath.Join(dir, "config"))
	s := &confSite{ca: testpki.NewCA(t, "ktls conformance CA")}
	leaf := s.ca.Server(t, "localhost")
	routes := []any{
		map[string]any{"match": []any{map[string]any{"path": []string{"/echo"}}},
			"handle": []any{map[string]any{"handler": "reverse_proxy", "upstreams": []any{map[string]any{"dial": lwHashUpstream(t)}}}}},
		map[string]any{"match": []any{map[string]any{"path": []string{h2specPath}}},
			"handle": []any{map[string]any{"handler": "test_delayed_response", "delay": h2specDelay.String()}}},
		map[string]any{"handle": []any{map[string]any{"handler": "static_response",
			"body": "{http.request.proto} {http.request.method} {http.request.uri} tls={http.request.tls.proto}\n"}}},
	}
	servers := map[string]any{}
	for i, protos := range confProtocols {
		for _, wrapped := range []bool{false, true} {
			addr := loopbackAddr(t)
			s.addrs = append(s.addrs, addr)
			srv := map[string]any{
				"listen":                  []string{addr},
				"protocols":               protos,
				"automatic_https":         map[string]any{"disable": true},
				"tls_connection_policies": []any{map[string]any{}},
				"routes":                  routes,
			}
			if wrapped {
				srv["listener_wrappers"] = []any{map[string]any{"wrapper": "ktls"}}
			}
			servers[fmt.Sprintf("s%d%v", i, wrapped)] = srv
		}
	}
	cfg, err := json.Marshal(map[string]any{
		"admin":   map[string]any{"disabled": true, "config": map[string]any{"persist": false}},
		"storage": map[string]any{"module": "file_system", "root": filepath.Join(dir, "storage")},
		"logging": map[string]any{"logs": map[string]any{"default": map[string]any{
			"level":  "DEBUG",
			"writer": map[string]any{"output": "file", "filename": filepath.Join(dir, "caddy.log")},
		}}},
		"apps": map[string]any{
			"tls": map[string]any{"certificates": map[string]any{"load_pem": []any{
				map[string]any{"certificate": string(leaf.CertPEM), "key": string(leaf.KeyPEM)},
			}}},
			"http": map[string]any{"servers": servers},
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	if err := caddy.Load(cfg, true); err != nil {
		t.Fatalf("load: %v", err)
	}
	t.Cleanup(func() {
		if err := caddy.Load([]byte(`{"admin":{"disabled":true,"config":{"persist":false}}}`), true); err != nil {
			t.Errorf("unload: %v", err)
		}
	})
	for _, a := range s.addrs {
		waitUntil(t, 10*time.Second, func() bool { return connectable(a) }, a+" to accept")
	}
	return s
}

// confLiveness bounds how long a case waits for the server to end a
// connection that it must end; it only decides how long a failing case
// takes.
const confLiveness = 30 * time.Second

// confCase is one scripted exchange; run returns what the client saw.
type confCase struct {
	name string
	run  func(t *testing.T, s *confSite, addr string) string
	// pri: the client opens with the HTTP/2 preface without having
	// negotiated h2. Where stock Caddy answers it as an HTTP/1.1 request
	// with method PRI, the wrapper closes the connection without a byte.
	pri bool
	// refusedEitherWay: the server answers before the client has sent all
	// it writes, then closes, so whether the client reads the answer or
	// first meets the close on its write is a race between the two, won
	// either way by either server. Both outcomes count as one: the
	// request refused, no other answer.
	refusedEitherWay bool
}

// refusedOutcome maps an exchange that ended in a close, with or without
// an HTTP/1.1 4xx answer before it, to one outcome; anything else is left
// as it is.
func refusedOutcome(out string) string {
	first, rest, _ := strings.Cut(out, "\n")
	if !strings.HasSuffix(first, " closed") || (rest != "" && !regexp.MustCompile(`^HTTP/1\.1 4\d\d `).MatchString(rest)) {
		return out
	}
	return "refused: a 4xx answer or the connection closed while the client wrote"
}

// confStep is what the client does next: write bytes, half-close, or read
// until the output holds a string.
type confStep struct {
	write     string
	closeSend bool
	until     string
}

// confExchange dials addr with TLS offering alpn (none: no ALPN), performs
// steps, then reads to the end and describes everything received: as
// HTTP/2 frames when h2 was negotiated, as text otherwise.
func (s *confSite) exchange(t *testing.T, addr string, alpn []string, version uint16, steps ...confStep) string {
	t.Helper()
	raw, err := net.Dial("tcp", addr)
	if err != nil {
		t.Fatal(err)
	}
	defer raw.Close()
	raw.SetDeadline(time.Now().Add(confLiveness))
	cfg := &tls.Config{RootCAs: s.ca.Pool, ServerName: "localhost", NextProtos: alpn}
	if version != 0 {
		cfg.MinVersion, cfg.MaxVersion = version, version
	}
	c := tls.Client(raw, cfg)
	if err := c.Handshake(); err != nil {
		return "handshake: " + err.Error()
	}
	var got bytes.Buffer
	end := ""
	for _, st := range steps {
		switch {
		case st.write != "":
			if _, err := io.WriteString(c, st.write); err != nil {
				end = confErr(err)
			}
		case st.closeSend:
			if err := c.CloseWrite(); err != nil {
				end = confErr(err)
			}
		case st.until != "":
			buf := make([]byte, 4096)
			for end == "" && !strings.Contains(got.String(), st.until) {
				n, err := c.Read(buf)
				got.Write(buf[:n])
				if err != nil {
					end = confErr(sockerr.ReadError(c, err))
				}
			}
		}
		if end != "" {
			break
		}
	}
	if end == "" {
		_, err := got.ReadFrom(c)
		end = confErr(sockerr.ReadError(c, err))
	}
	state := c.ConnectionState()
	desc := fmt.Sprintf("alpn=%q %s\n", state.NegotiatedProtocol, end)
	if state.NegotiatedProtocol == "h2" {
		return desc + confFrames(got.Bytes())
	}
	return desc + confText(got.String())
}

// confErr names how a read or write ended. A close_notify, a FIN, a
// reset and a write into a closed connection all say the server closed it:
// which one a client sees depends on whether the server had read
// everything the client sent before it closed, which the two servers need
// not agree on; TLS alerts and a connection left open are named as such.
func confErr(err error) string {
	var ne net.Error
	switch {
	case err == nil, err == io.EOF, errors.Is(err, syscall.ECONNRESET), errors.Is(err, syscall.EPIPE):
		return "closed"
	case errors.As(err, &ne) && ne.Timeout():
		return fmt.Sprintf("still open after %v", confLiveness)
	}
	return err.Error()
}

// confDate matches the headers that differ between two responses by time.
var confDate = regexp.MustCompile(`(?m)^Date: .*\r\n`)

func confText(s string) string { return confDate.ReplaceAllString(s, "Date: *\r\n") }

// confFrames describes HTTP/2 frames: type, flags, and what a client acts
// on (settings, error codes, decoded headers but date, data). The server's
// connection setup (its SETTINGS, its connection WINDOW_UPDATE, its ACK of
// the client's SETTINGS) comes first, sorted: the HTTP/2 server writes it
// in an order that depends on when the client's SETTINGS arrived. A
// connection that ended after nothing but the server's setup is described
// as empty: the HTTP/2 server writes its SETTINGS before it reads the
// preface, and a wrapped connection is closed before that.
func confFrames(b []byte) string {
	var setup []string
	var out strings.Builder
	defer func() {
		rest := out.String()
		out.Reset()
		if rest == "" {
			return
		}
		slices.Sort(setup)
		for _, f := range setup {
			out.WriteString(f + "\n")
		}
		out.WriteString(rest)
	}()
	fr := http2.NewFramer(io.Discard, bytes.NewReader(b))
	dec := hpack.NewDecoder(4096, nil)
	for {
		f, err := fr.ReadFrame()
		if err != nil {
			if err != io.EOF {
				fmt.Fprintf(&out, "unparsed: %v\n", err)
			}
			return out.String()
		}
		h := f.Header()
		if h.StreamID == 0 && (h.Type == http2.FrameSettings || h.Type == http2.FrameWindowUpdate) && len(setup) < 3 && out.Len() == 0 {
			var d strings.Builder
			fmt.Fprintf(&d, "%v flags=%v", h.Type, h.Flags)
			switch f := f.(type) {
			case *http2.SettingsFrame:
				f.ForeachSetting(func(s http2.Setting) error { fmt.Fprintf(&d, " %v", s); return nil })
			case *http2.WindowUpdateFrame:
				fmt.Fprintf(&d, " +%d", f.Increment)
			}
			setup = append(setup, d.String())
			continue
		}
		fmt.Fprintf(&out, "%v stream=%d flags=%v", h.Type, h.StreamID, h.Flags)
		switch f := f.(type) {
		case *http2.SettingsFrame:
			f.ForeachSetting(func(s http2.Setting) error { fmt.Fprintf(&out, " %v", s); return nil })
		case *http2.GoAwayFrame:
			fmt.Fprintf(&out, " %v last=%d %q", f.ErrCode, f.LastStreamID, f.DebugData())
		case *http2.RSTStreamFrame:
			fmt.Fprintf(&out, " %v", f.ErrCode)
		case *http2.WindowUpdateFrame:
			fmt.Fprintf(&out, " +%d", f.Increment)
		case *http2.HeadersFrame:
			fields, _ := dec.DecodeFull(f.HeaderBlockFragment())
			for _, hf := range fields {
				if hf.Name == "date" {
					hf.Value = "*"
				}
				fmt.Fprintf(&out, " %s=%q", hf.Name, hf.Value)
			}
		case *http2.DataFrame:
			fmt.Fprintf(&out, " %q", f.Data())
		}
		out.WriteByte('\n')
	}
}

// confH2 frames the client's side of an HTTP/2 exchange.
func confH2(f func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer)) string {
	var b, hb bytes.Buffer
	fr := http2.NewFramer(&b, nil)
	f(fr, hpack.NewEncoder(&hb), &hb)
	return b.String()
}

// confRequestHeaders encodes a request's header block.
func confRequestHeaders(enc *hpack.Encoder, hb *bytes.Buffer, method, path string, extra ...string) []byte {
	hb.Reset()
	fields := append([]string{":method", method, ":scheme", "https", ":authority", "localhost", ":path", path}, extra...)
	for i := 0; i+1 < len(fields); i += 2 {
		enc.WriteField(hpack.HeaderField{Name: fields[i], Value: fields[i+1]})
	}
	return slices.Clone(hb.Bytes())
}

var (
	alpnH1   = []string{"http/1.1"}
	alpnH2   = []string{"h2"}
	alpnBoth = []string{"h2", "http/1.1"}
)

// h1 is a case of text steps over ALPN http/1.1.
func h1(name string, steps ...confStep) confCase {
	return confCase{name: name, run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH1, 0, steps...)
	}}
}

func w(s string) confStep { return confStep{write: s} }

const get = "GET / HTTP/1.1\r\nHost: localhost\r\n\r\n"
const getClose = "GET /last HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"

// The HTTP/2 client preface and an empty SETTINGS frame.
var h2Start = http2.ClientPreface + confH2(func(fr *http2.Framer, _ *hpack.Encoder, _ *bytes.Buffer) {
	fr.WriteSettings()
})

// h2Get is a whole HTTP/2 GET on stream 1, then GOAWAY.
var h2Get = h2Start + confH2(func(fr *http2.Framer, enc *hpack.Encoder, hb *bytes.Buffer) {
	fr.WriteHeaders(http2.HeadersFrameParam{StreamID: 1, BlockFragment: confRequestHeaders(enc, hb, "GET", "/h2"),
		EndStream: true, EndHeaders: true})
})

var confCases = []confCase{
	h1("get", w(getClose)),
	h1("keep-alive then close", w(get), confStep{until: "\r\n\r\n"}, w(getClose)),
	h1("pipelined", w(get+"GET /2 HTTP/1.1\r\nHost: localhost\r\n\r\n"+getClose)),
	// A handler that does not read the body: no 100 Continue, and the body
	// is never sent. (Through reverse_proxy, which forwards the upstream's
	// 100, what a client reads depends on timing in Caddy itself.)
	h1("expect 100-continue, body not read",
		w("POST / HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nExpect: 100-continue\r\nConnection: close\r\n\r\n")),
	h1("expect unknown", w("POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\nExpect: 200-ok\r\n\r\nhello")),
	h1("slow body", w("POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 12\r\nConnection: close\r\n\r\nhel"),
		w("lo "), w("wor"), w("ld!")),
	h1("slow headers", w("GET /slow HTT"), w("P/1.1\r\nHo"), w("st: localhost\r\nConnec"), w("tion: close\r\n\r\n")),
	h1("chunked body with trailer",
		w("POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\nConnection: close\r\n\r\n5\r\nhello\r\n0\r\nX-T: 1\r\n\r\n")),
	h1("smuggling: content-length and chunked",
		w("POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\nTransfer-Encoding: chunked\r\n\r\n0\r\n\r\nGET /smuggled HTTP/1.1\r\nHost: localhost\r\n\r\n"+getClose)),
	h1("smuggling: two content-lengths",
		w("POST /echo HTTP/1.1\r\nHost: localhost\r\nContent-Length: 4\r\nContent-Length: 5\r\n\r\nhello")),
	h1("smuggling: bad chunk size", w("POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\nhello\r\n0\r\n\r\n")),
	h1("smuggling: chunked not last", w("POST /echo HTTP/1.1\r\nHost: localhost\r\nTransfer-Encoding: chunked, identity\r\n\r\n0\r\n\r\n")),
	h1("smuggling: obs-fold", w("GET / HTTP/1.1\r\nHost: localhost\r\nX-A: 1\r\n folded\r\n\r\n"+getClose)),
	h1("smuggling: space before colon", w("GET / HTTP/1.1\r\nHost: localhost\r\nContent-Length : 5\r\n\r\nhello")),
	h1("bare LF", w("GET /lf HTTP/1.1\nHost: localhost\nConnection: close\n\n")),
	h1("no host", w("GET / HTTP/1.1\r\n\r\n")),
	h1("HTTP/1.0", w("GET /old HTTP/1.0\r\n\r\n")),
	h1("absolute form", w("GET https://localhost/abs HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")),
	h1("bad method", w("G@T / HTTP/1.1\r\nHost: localhost\r\n\r\n")),
	h1("garbage", w("\x00\x01\x02 nonsense\r\n\r\n")),
	func() confCase {
		// Caddy answers 431 after 1 MiB of headers, while the client is
		// still writing the second.
		c := h1("header too large", w("GET / HTTP/1.1\r\nHost: localhost\r\nX-Big: "+strings.Repeat("a", 2<<20)+"\r\n\r\n"))
		c.refusedEitherWay = true
		return c
	}(),
	h1("unsupported version", w("GET / HTTP/3.0\r\nHost: localhost\r\n\r\n")),
	h1("upgrade h2c ignored", w("GET /up HTTP/1.1\r\nHost: localhost\r\nConnection: Upgrade, HTTP2-Settings, close\r\nUpgrade: h2c\r\nHTTP2-Settings: AAMAAABkAAQAoAAAAAIAAAAA\r\n\r\n")),
	h1("request then close_notify", w(get), confStep{closeSend: true}),
	h1("close_notify before a whole request", w("GET / HTTP/1.1\r\nHost: loc"), confStep{closeSend: true}),
	h1("body left unread, then another request", w("POST /ignored HTTP/1.1\r\nHost: localhost\r\nContent-Length: 5\r\n\r\nhello"+getClose)),
	{name: "h2 preface over http/1.1", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH1, 0, w(h2Get))
	}, pri: true},
	{name: "h2 preface without ALPN", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, nil, 0, w(h2Get))
	}, pri: true},
	{name: "h1 without ALPN", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, nil, 0, w(getClose))
	}},
	{name: "h1 over TLS 1.2", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnBoth, tls.VersionTLS12, w(getClose))
	}},
	{name: "unknown ALPN", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, []string{"spdy/3"}, 0, w(getClose))
	}},
	{name: "h2 get", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH2, 0, w(h2Get), confStep{until: "/h2"}, w(confGoAway()))
	}},
	{name: "h2 over TLS 1.2", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnBoth, tls.VersionTLS12, w(h2Get), confStep{until: "/h2"}, w(confGoAway()))
	}, pri: true}, // on a server without h2, ALPN picks http/1.1
	{name: "h2 negotiated, HTTP/1.1 sent", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH2, 0, w(getClose))
	}},
	{name: "h2 negotiated, preface cut short", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH2, 0, w(http2.ClientPreface[:10]), confStep{closeSend: true})
	}},
	{name: "h2 negotiated, preface wrong at its end", run: func(t *testing.T, s *confSite, addr string) string {
		return s.exchange(t, addr, alpnH2, 0, w(http2.ClientPreface[:22]+"XX"))
	}},
}

func confGoAway() string {
	return confH2(func(fr *http2.Framer, _ *hpack.Encoder, _ *bytes.Buffer) { fr.WriteGoAway(0, http2.ErrCodeNo, nil) })
}

// confH2Spec runs h2spec against both servers and compares every case's
// result. The cases that raced with Go's HTTP/2 server's response are
// settled by h2specPath's delay; should another case race, a case whose
// results differ is run again on both, and only a result the wrapper gives
// that stock Caddy never gave in those runs (nor the reverse) is a
// difference.
func confH2Spec(t *testing.T, s *confSite, stockRun, wrappedRun *h2specProcess) {
	stock, wrapped := stockRun.addr, wrappedRun.addr
	want, got := stockRun.results(t), wrappedRun.results(t)
	if len(want) < 100 {
		t.Fatalf("h2spec reported %d cases against stock Caddy, want the whole suite", len(want))
	}
	notPassed := 0
	for name, w := range want {
		if w.result != "passed" {
			notPassed++
		}
		g, ok := got[name]
		if !ok {
			t.Errorf("h2spec %s: no result with ktls", name)
			continue
		}
		if g.result == w.result {
			continue
		}
		seenStock, seenKTLS := map[string]bool{w.result: true}, map[string]bool{g.result: true}
		for range 3 {
			seenStock[h2specRun(t, stock, w.id)[name].result] = true
			seenKTLS[h2specRun(t, wrapped, w.id)[name].result] = true
		}
		common := false
		for r := range seenKTLS {
			common = common || seenStock[r]
		}
		if !common {
			t.Errorf("h2spec %s (%s): stock Caddy %v, with ktls %v", name, w.id, slices.Sorted(maps.Keys(seenStock)), slices.Sorted(maps.Keys(seenKTLS)))
		} else {
			t.Logf("h2spec %s (%s): stock Caddy %v, with ktls %v over 4 runs: a race in the HTTP/2 server, not a difference", name, w.id, slices.Sorted(maps.Keys(seenStock)), slices.Sorted(maps.Keys(seenKTLS)))
		}
	}
	for name, g := range got {
		if _, ok := want[name]; !ok {
			t.Errorf("h2spec %s: only with ktls (%s)", name, g.result)
		}
	}
	t.Logf("h2spec: %d cases, the same results on both (%d not passed by stock Caddy either)", len(want), notPassed)
}

// h2specPath is the path h2spec requests, answered h2specDelay after the
// request's HEADERS. Several cases send HEADERS without END_STREAM and,
// right behind them, a frame that is a stream error (a WINDOW_UPDATE past
// 2^31-1, DATA beyond the content-length), or more streams than the server
// allows at once. An immediate response ends the stream (RST_STREAM
// NO_ERROR) or frees its slot, and whether that or the server's reading
// of the next frame comes first depends on scheduling, which differs with
// and without kTLS: with the delay the frames are read first on both.
const h2specPath = "/h2spec"

const h2specDelay = 200 * time.Millisecond

// h2specCase is one h2spec case's ID (to run it alone) and result.
type h2specCase struct{ id, result string }

// h2specRun runs h2spec (the cases given, or all) against addr and returns
// each case's result by its section and name.
func h2specRun(t *testing.T, addr string, cases ...string) map[string]h2specCase {
	t.Helper()
	return h2specStart(t, addr, cases...).results(t)
}

// h2specProcess is a running h2spec.
type h2specProcess struct {
	addr   string
	cmd    *exec.Cmd
	out    bytes.Buffer
	report string
}

// h2specStart starts h2spec (the cases given, or all) against addr.
func h2specStart(t *testing.T, addr string, cases ...string) *h2specProcess {
	t.Helper()
	_, port, _ := net.SplitHostPort(addr)
	p := &h2specProcess{addr: addr, report: filepath.Join(t.TempDir(), "report.xml")}
	// -o: seconds h2spec waits for an expected frame; a liveness bound
	// for an emulated CPU, not a measurement.
	args := append([]string{"-t", "-k", "-h", "127.0.0.1", "-p", port, "-P", h2specPath, "-o", "10", "-j", p.report}, cases...)
	p.cmd = exec.Command(h2specBinary(t), args...)
	p.cmd.Stdout, p.cmd.Stderr = &p.out, &p.out
	if err := p.cmd.Start(); err != nil {
		t.Fatalf("h2spec: %v", err)
	}
	t.Cleanup(func() {
		if p.cmd.ProcessState == nil { // never waited for: the test failed first
			p.cmd.Process.Kill()
			p.cmd.Wait()
		}
	})
	return p
}

// results waits for p to end and returns each case's result by its
// section and name (h2spec exits non-zero when a case failed).
func (p *h2specProcess) results(t *testing.T) map[string]h2specCase {
	t.Helper()
	err := p.cmd.Wait()
	if _, ok := err.(*exec.ExitError); err != nil && !ok {
		t.Fatalf("h2spec: %v\n%s", err, p.out.Bytes())
	}
	return h2specResults(t, p.report, p.out.Bytes())
}

// h2specBinary is the h2spec that `make tools` builds (override:
// KTLS_H2SPEC). Outside the VM, a bin/h2spec that is missing or older than
// integration/tools/go.mod or go.sum is built first, as `make tools` does,
// so that `go test ./...` runs on a fresh clone; in the VM the checkout is
// read-only and the harness has built it on the host.
func h2specBinary(t *testing.T) string {
	t.Helper()
	if os.Getenv("KTLS_H2SPEC") == "" && !kerneltest.Required() && h2specStale(filepath.Join("bin", "h2spec")) {
		buildH2spec(t, filepath.Join("bin", "h2spec"))
	}
	return builtBinary(t, "KTLS_H2SPEC", "h2spec", "tools")
}

// h2specStale reports whether bin is missing or older than the files that
// pin h2spec's version.
func h2specStale(bin string) bool {
	info, err := os.Stat(bin)
	if err != nil {
		return true
	}
	for _, pin := range []string{"integration/tools/go.mod", "integration/tools/go.sum"} {
		if p, err := os.Stat(pin); err != nil || p.ModTime().After(info.ModTime()) {
			return true
		}
	}
	return false
}

// buildH2spec builds the h2spec that integration/tools/go.mod pins into
// out, beside it first and renamed over it.
func buildH2spec(t *testing.T, out string) {
	t.Helper()
	goTool, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("building %s needs the go command (or run `make tools`, or set KTLS_H2SPEC): %v", out, err)
	}
	abs, err := filepath.Abs(out)
	if err != nil {
		t.Fatal(err)
	}
	if err := os.MkdirAll(filepath.Dir(abs), 0o755); err != nil {
		t.Fatal(err)
	}
	tmp := filepath.Join(filepath.Dir(abs), fmt.Sprintf(".h2spec.%d", os.Getpid()))
	cmd := exec.Command(goTool, "build", "-o", tmp, "github.com/summerwind/h2spec/cmd/h2spec")
	cmd.Dir = filepath.Join("integration", "tools")
	if out, err := cmd.CombinedOutput(); err != nil {
		os.Remove(tmp)
		t.Fatalf("building h2spec (integration/tools, as `make tools` does): %v\n%s", err, out)
	}
	if err := os.Rename(tmp, abs); err != nil {
		t.Fatal(err)
	}
}

// h2specResults reads h2spec's JUnit report.
func h2specResults(t *testing.T, report string, out []byte) map[string]h2specCase {
	t.Helper()
	b, err := os.ReadFile(report)
	if err != nil {
		t.Fatalf("h2spec wrote no report: %v\n%s", err, out)
	}
	var suites struct {
		Suites []struct {
			Name    string `xml:"name,attr"`
			Package string `xml:"package,attr"`
			Cases   []struct {
				Name    string    `xml:"classname,attr"`
				Failure *struct{} `xml:"failure"`
				Skipped *struct{} `xml:"skipped"`
				Error   *struct{} `xml:"error"`
			} `xml:"testcase"`
		} `xml:"testsuite"`
	}
	if err := xml.Unmarshal(b, &suites); err != nil {
		t.Fatalf("h2spec report: %v", err)
	}
	res := map[string]h2specCase{}
	for _, s := range suites.Suites {
		for i, c := range s.Cases {
			r := "passed"
			switch {
			case c.Failure != nil:
				r = "failed"
			case c.Error != nil:
				r = "error"
			case c.Skipped != nil:
				r = "skipped"
			}
			res[s.Name+" / "+c.Name] = h2specCase{fmt.Sprintf("%s/%d", s.Package, i+1), r}
		}
	}
	return res
}

// The two outcomes of the header-too-large race are one; a served request,
// or an exchange that did not end in a close, is not.
func TestRefusedOutcome(t *testing.T) {
	refused := refusedOutcome(`alpn="http/1.1" closed` + "\n")
	for out, same := range map[string]bool{
		`alpn="http/1.1" closed` + "\nHTTP/1.1 431 Request Header Fields Too Large\nConnection: close\n": true,
		`alpn="http/1.1" closed` + "\nHTTP/1.1 200 OK\n":                                                 false,
		`alpn="http/1.1" left open` + "\n":                                                               false,
		`alpn="http/1.1" tls alert: bad record MAC` + "\n":                                               false,
	} {
		if got := refusedOutcome(out) == refused; got != same {
			t.Errorf("refusedOutcome(%q) is the refused outcome: %v, want %v", out, got, same)
		}
	}
}

// TestH2specBuiltOnDemand: the conformance test's h2spec is built from
// integration/tools when it is missing or older than its pins, as the
// tests build Caddy, so that `go test ./...` runs on a fresh clone.
func TestH2specBuiltOnDemand(t *testing.T) {
	bin := filepath.Join(t.TempDir(), "bin", "h2spec")
	if !h2specStale(bin) {
		t.Fatal("a missing h2spec is not stale")
	}
	buildH2spec(t, bin)
	out, err := exec.Command(bin, "--help").CombinedOutput()
	if err != nil || !strings.Contains(string(out), "Conformance testing tool for HTTP/2 implementation") {
		t.Fatalf("the h2spec built: %v\n%s", err, out)
	}
	if h2specStale(bin) {
		t.Error("an h2spec just built is stale")
	}
	old := time.Date(2000, 1, 1, 0, 0, 0, 0, time.UTC)
	if err := os.Chtimes(bin, old, old); err != nil {
		t.Fatal(err)
	}
	if !h2specStale(bin) {
		t.Error("an h2spec older than integration/tools/go.mod is not stale")
	}
}
