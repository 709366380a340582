package forwarder

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"mime"
	"net/http"
	"slices"
	"time"

	"github.com/caddyserver/caddy/v2"
	"go.uber.org/zap"

	"github.com/ktlsingress/caddy-ktls/forward"
	"github.com/ktlsingress/caddy-ktls/internal/adminapi"
	"github.com/ktlsingress/caddy-ktls/internal/moduleid"
	"github.com/ktlsingress/caddy-ktls/preamble"
)

func init() {
	caddy.RegisterModule(AdminAPI{})
}

// AdminAPI is the admin API module `admin.api.sandbox`. It serves the
// process-level tunnel registry as JSON:
//
//   - GET /sandbox/tunnels: the open tunnels (forward.TunnelInfo), oldest
//     first;
//   - GET /sandbox/activity: per-sandbox totals (forward.SandboxActivity),
//     the latest activity report's identity (its sequence), the sandboxes
//     refused after a close, and the rejections counted so far by reason;
//   - POST /sandbox/close: ends the tunnels of a sandbox or of a client
//     certificate (CloseRequest), at once or after a grace period, and
//     optionally refuses new tunnels to the sandbox for a while.
//
// POST /sandbox/upgrade is modules/handoff's (admin.api.sandbox_handoff).
//
// The GETs read live counters and never block the data path.
type AdminAPI struct{}

// CaddyModule returns the Caddy module information.
func (AdminAPI) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleid.AdminSandbox, New: func() caddy.Module { return new(AdminAPI) }}
}

// Routes returns the admin routes.
func (AdminAPI) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		adminapi.Route("/sandbox/tunnels", serveTunnels),
		adminapi.Route("/sandbox/activity", serveActivity),
		adminapi.Route("/sandbox/close", serveClose),
	}
}

// ActivityResponse is the body of GET /sandbox/activity.
type ActivityResponse struct {
	Sandboxes []forward.SandboxActivity `json:"sandboxes"`
	// LastReport identifies the latest activity report taken (by any
	// pusher of the process): its id and sequence, the same as in the
	// report itself; null before the first. The sandboxes'
	// reported_bytes_* are the totals of the reports up to it.
	LastReport *forward.ReportID `json:"last_report"`
	// Refusing are the sandboxes a close refuses new tunnels to, until when.
	Refusing   []forward.Refusal `json:"refusing"`
	Rejections map[string]uint64 `json:"rejections"`
}

func serveTunnels(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errMethod}
	}
	return writeJSON(w, tunnels.Tunnels())
}

func serveActivity(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodGet {
		return caddy.APIError{HTTPStatus: http.StatusMethodNotAllowed, Err: errMethod}
	}
	return writeJSON(w, activityOfRegistry(tunnels))
}

// activityOfRegistry is GET /sandbox/activity's answer for reg.
func activityOfRegistry(reg *forward.Registry) ActivityResponse {
	a := ActivityResponse{Sandboxes: reg.Activity(), Refusing: reg.Refusals(), Rejections: reg.RefusedTunnels()}
	if last := reg.LastReport(); last.Sequence != 0 {
		a.LastReport = &last
	}
	return a
}

// The close modes.
const (
	closeModeFail     = "fail"
	closeModeGraceful = "graceful"
)

// CloseRequest is the body of POST /sandbox/close.
type CloseRequest struct {
	// Sandbox ends the tunnels to this sandbox ID.
	// It is case-insensitive; the answer and the logs give its lowercase
	// form, the one tunnels carry.
	Sandbox string `json:"sandbox,omitempty"`
	// ClientCertificate ends the tunnels opened with this client
	// certificate: its subject (as GET /sandbox/tunnels shows it, e.g.
	// "CN=gateway-1"), Common Name or a DNS name. Exactly one of sandbox
	// and client_certificate.
	ClientCertificate string `json:"client_certificate,omitempty"`
	// Mode is "fail" (the tunnels end now, as failures: both sides are
	// aborted) or "graceful" (they may run for grace, then those still
	// open end as failures). Required.
	Mode string `json:"mode"`
	// Grace is how long "graceful" lets the tunnels run. Required with
	// "graceful", refused with "fail". In the JSON, a duration string with
	// its unit ("30s", "1m30s", "1d"); a bare number is refused, it has no
	// unit.
	Grace caddy.Duration `json:"grace,omitempty"`
	// RefuseFor refuses new tunnels to the sandbox for this long (reason
	// "sandbox-closed"), across configuration reloads. Only with sandbox.
	// A duration string, as Grace. At most forward.MaxRefusals sandboxes
	// are refused at once: a close that would refuse one more is refused
	// (429) and ends nothing.
	RefuseFor caddy.Duration `json:"refuse_for,omitempty"`
}

// closeRequestJSON is CloseRequest as the body spells it: the durations
// raw, so that parseCloseDuration can refuse a bare number by its field.
type closeRequestJSON struct {
	CloseRequest
	Grace     json.RawMessage `json:"grace"`
	RefuseFor json.RawMessage `json:"refuse_for"`
}

// maxCloseBody bounds a POST /sandbox/close body; a close request is a few
// hundred bytes.
const maxCloseBody = 64 << 10

// Why a POST /sandbox/close was refused, as
// caddy_ktls_sandbox_close_refused_total counts it and its log line says.
const (
	closeRefusedMethod      = "method"        // not a POST (405)
	closeRefusedContentType = "content-type"  // not Content-Type: application/json (415)
	closeRefusedTooLarge    = "too-large"     // a body over maxCloseBody (413)
	closeRefusedBadRequest  = "bad-request"   // a body that is no valid close request (400)
	closeRefusedFull        = "refusals-full" // refuse_for beyond forward.MaxRefusals (429)
)

// refuseClose counts and logs a refused POST /sandbox/close, and returns
// the admin API's answer to it: status, and err as the body's "error".
func refuseClose(status int, reason string, err error) error {
	closeRefusals.Add(reason)
	err = fmt.Errorf("POST /sandbox/close: %w", err)
	caddy.Log().Named("admin.api.sandbox").Warn("POST /sandbox/close refused; nothing was closed",
		zap.String("reason", reason), zap.Int("status", status), zap.Error(err))
	return caddy.APIError{HTTPStatus: status, Err: err}
}

// CloseResponse is the answer to POST /sandbox/close.
type CloseResponse struct {
	Sandbox           string `json:"sandbox,omitempty"`
	ClientCertificate string `json:"client_certificate,omitempty"`
	Mode              string `json:"mode"`
	// Tunnels are the IDs of the tunnels the close ended ("fail"), or
	// that it ends at deadline unless they end first ("graceful").
	Tunnels []uint64 `json:"tunnels"`
	// Count is len(tunnels).
	Count int `json:"count"`
	// Deadline is when "graceful" ends the tunnels still open.
	Deadline *time.Time `json:"deadline,omitempty"`
	// RefusingUntil is when new tunnels to the sandbox are admitted again.
	RefusingUntil *time.Time `json:"refusing_until,omitempty"`
}

func serveClose(w http.ResponseWriter, r *http.Request) error {
	if r.Method != http.MethodPost {
		return refuseClose(http.StatusMethodNotAllowed, closeRefusedMethod, errors.New("method not allowed: use POST"))
	}
	if ct := r.Header.Get("Content-Type"); mediaType(ct) != "application/json" {
		return refuseClose(http.StatusUnsupportedMediaType, closeRefusedContentType,
			fmt.Errorf("Content-Type %q: send the close request as JSON, with the header Content-Type: application/json", ct))
	}
	tooLarge := fmt.Errorf("the body is over the limit of %d bytes: send one close request", maxCloseBody)
	if r.ContentLength > maxCloseBody {
		return refuseClose(http.StatusRequestEntityTooLarge, closeRefusedTooLarge, tooLarge)
	}
	body, err := io.ReadAll(http.MaxBytesReader(w, r.Body, maxCloseBody))
	if _, ok := errors.AsType[*http.MaxBytesError](err); ok {
		return refuseClose(http.StatusRequestEntityTooLarge, closeRefusedTooLarge, tooLarge)
	}
	if err != nil {
		return refuseClose(http.StatusBadRequest, closeRefusedBadRequest, fmt.Errorf("reading the body: %w", err))
	}
	req, err := decodeCloseRequest(body)
	if err != nil {
		return refuseClose(http.StatusBadRequest, closeRefusedBadRequest, err)
	}
	logger := caddy.Log().Named("admin.api.sandbox")
	// what names the close in every line it logs; the grace end's line
	// adds the tunnels it cut, the answer's those it selected.
	what := []zap.Field{zap.String("sandbox", req.Sandbox), zap.String("client_certificate", req.ClientCertificate),
		zap.String("mode", req.Mode)}
	res, err := tunnels.Close(forward.CloseRequest{
		Sandbox: req.Sandbox, Certificate: req.ClientCertificate,
		Grace: time.Duration(req.Grace), RefuseFor: time.Duration(req.RefuseFor),
		OnGraceEnd: func(ended []forward.TunnelInfo) {
			f := append(slices.Clip(what), zap.Int("tunnels", len(ended)), zap.Uint64s("ids", tunnelIDs(ended)))
			if len(ended) > 0 {
				logger.Warn("closed tunnels still open after the close grace period", f...)
			} else {
				logger.Info("every closed tunnel ended within the close grace period", f...)
			}
		},
	})
	if full, ok := errors.AsType[*forward.RefusalsFullError](err); ok {
		return refuseClose(http.StatusTooManyRequests, closeRefusedFull, fmt.Errorf("%w: nothing was closed; retry once a refusal has ended "+
			`(GET /sandbox/activity lists them under "refusing"), or close without "refuse_for" (the limit is %d sandboxes)`, full, full.Max))
	}
	if err != nil {
		return refuseClose(http.StatusBadRequest, closeRefusedBadRequest, err)
	}
	closeRequests.Add(req.Mode)
	out := CloseResponse{Sandbox: req.Sandbox, ClientCertificate: req.ClientCertificate, Mode: req.Mode,
		Tunnels: tunnelIDs(res.Tunnels), Count: len(res.Tunnels)}
	fields := append(slices.Clip(what), zap.Int("tunnels", out.Count), zap.Uint64s("ids", out.Tunnels))
	if !res.RefusingUntil.IsZero() {
		out.RefusingUntil = &res.RefusingUntil
		fields = append(fields, zap.Time("refusing_until", res.RefusingUntil))
	}
	if req.Mode == closeModeGraceful {
		out.Deadline = &res.Deadline
		logger.Info("closing sandbox tunnels on demand: those still open at the deadline end as failures",
			append(fields, zap.Time("deadline", res.Deadline))...)
	} else {
		logger.Warn("closed sandbox tunnels on demand", fields...)
	}
	return writeJSON(w, out)
}

// decodeCloseRequest reads and checks a POST /sandbox/close body.
func decodeCloseRequest(body []byte) (CloseRequest, error) {
	var wire closeRequestJSON
	dec := json.NewDecoder(bytes.NewReader(body))
	dec.DisallowUnknownFields()
	if err := dec.Decode(&wire); err != nil {
		return wire.CloseRequest, fmt.Errorf(`the body is not a close request (%v): send {"sandbox": "<id>", "mode": "fail"}, or "graceful" with "grace", and optionally "refuse_for"`, err)
	}
	if dec.More() {
		return wire.CloseRequest, errors.New("the body holds more than one JSON value: send one close request")
	}
	req := wire.CloseRequest
	var err error
	if req.Grace, err = parseCloseDuration("grace", wire.Grace); err != nil {
		return req, err
	}
	if req.RefuseFor, err = parseCloseDuration("refuse_for", wire.RefuseFor); err != nil {
		return req, err
	}
	if req.Sandbox != "" {
		// Sandbox IDs are case-insensitive: a close of any spelling
		// closes and refuses the one sandbox, by its lowercase ID.
		id, err := preamble.CanonicalSandboxID(req.Sandbox)
		if err != nil {
			var pe *preamble.Error
			errors.As(err, &pe)
			return req, fmt.Errorf(`"sandbox": %s`, pe.Detail)
		}
		req.Sandbox = id
	}
	switch {
	case req.Sandbox == "" && req.ClientCertificate == "":
		return req, errors.New(`name what to close: "sandbox" (a sandbox ID) or "client_certificate" (a subject, Common Name or DNS name)`)
	case req.Sandbox != "" && req.ClientCertificate != "":
		return req, errors.New(`name one of "sandbox" and "client_certificate", not both`)
	case req.Grace < 0 || req.RefuseFor < 0:
		return req, errors.New(`"grace" and "refuse_for" must not be negative`)
	case req.RefuseFor > 0 && req.Sandbox == "":
		return req, errors.New(`"refuse_for" applies to a sandbox: to refuse a client certificate, remove it from the TLS connection policy`)
	}
	switch req.Mode {
	case closeModeFail:
		if req.Grace != 0 {
			return req, errors.New(`"grace" is for mode "graceful": mode "fail" ends the tunnels at once`)
		}
	case closeModeGraceful:
		if req.Grace == 0 {
			return req, errors.New(`mode "graceful" needs "grace", how long the tunnels may run (e.g. "30s")`)
		}
	case "":
		return req, errors.New(`no "mode": give "fail" (end the tunnels now) or "graceful" (with "grace")`)
	default:
		return req, fmt.Errorf(`unknown mode %q: give "fail" (end the tunnels now) or "graceful" (with "grace")`, req.Mode)
	}
	return req, nil
}

// parseCloseDuration reads the duration field name of a close request: a
// JSON string with a unit, as Caddy parses durations. A bare number is
// refused: it has no unit (Caddy's own duration fields read it as
// nanoseconds, so "grace": 30 would be 30ns).
func parseCloseDuration(name string, raw json.RawMessage) (caddy.Duration, error) {
	if len(raw) == 0 {
		return 0, nil
	}
	var s string
	if err := json.Unmarshal(raw, &s); err != nil {
		return 0, fmt.Errorf(`%q: %s is not a duration string: give the duration with its unit, e.g. %q: "30s"`, name, raw, name)
	}
	d, err := caddy.ParseDuration(s)
	if err != nil {
		return 0, fmt.Errorf(`%q: %q is not a duration (%v): give it with its unit, e.g. "30s", "1m30s" or "2h"`, name, s, err)
	}
	return caddy.Duration(d), nil
}

// mediaType is the media type of a Content-Type header, lowercased and
// without parameters; "" when it has none or cannot be parsed.
func mediaType(contentType string) string {
	mt, _, err := mime.ParseMediaType(contentType)
	if err != nil {
		return ""
	}
	return mt
}

func tunnelIDs(list []forward.TunnelInfo) []uint64 {
	ids := make([]uint64, len(list))
	for i, ti := range list {
		ids[i] = ti.ID
	}
	return ids
}

var errMethod = errors.New("method not allowed: use GET")

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// Interface guard.
var _ caddy.AdminRouter = AdminAPI{}
