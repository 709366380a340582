package caddyktls

import (
	"encoding/json"
	"errors"
	"net/http"

	"github.com/caddyserver/caddy/v2"

	"github.com/ktlsingress/caddy-ktls/forward"
)

func init() {
	caddy.RegisterModule(AdminSandbox{})
}

// AdminSandbox is the admin API module `admin.api.sandbox`. It serves the
// process-level tunnel registry as JSON:
//
//   - GET /sandbox/tunnels: the open tunnels (forward.TunnelInfo), oldest
//     first;
//   - GET /sandbox/activity: per-sandbox totals (forward.SandboxActivity)
//     and the rejections counted so far by reason.
//
// Both read live counters and never block the data path.
type AdminSandbox struct{}

// CaddyModule returns the Caddy module information.
func (AdminSandbox) CaddyModule() caddy.ModuleInfo {
	return caddy.ModuleInfo{ID: moduleAdminSandbox, New: func() caddy.Module { return new(AdminSandbox) }}
}

// Routes returns the admin routes.
func (AdminSandbox) Routes() []caddy.AdminRoute {
	return []caddy.AdminRoute{
		{Pattern: "/sandbox/tunnels", Handler: caddy.AdminHandlerFunc(serveTunnels)},
		{Pattern: "/sandbox/activity", Handler: caddy.AdminHandlerFunc(serveActivity)},
	}
}

// ActivityResponse is the body of GET /sandbox/activity.
type ActivityResponse struct {
	Sandboxes  []forward.SandboxActivity `json:"sandboxes"`
	Rejections map[string]uint64         `json:"rejections"`
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
	return writeJSON(w, ActivityResponse{Sandboxes: tunnels.Activity(), Rejections: tunnels.Rejections()})
}

var errMethod = errors.New("method not allowed: use GET")

func writeJSON(w http.ResponseWriter, v any) error {
	w.Header().Set("Content-Type", "application/json")
	return json.NewEncoder(w).Encode(v)
}

// Interface guard.
var _ caddy.AdminRouter = AdminSandbox{}
