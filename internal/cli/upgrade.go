package cli

import (
	"errors"
	"fmt"
	"io"
	"net/http"

	caddycmd "github.com/caddyserver/caddy/v2/cmd"
	"github.com/spf13/cobra"
)

// upgradeCommand is "caddy sandbox upgrade": the running forwarder starts
// the binary now installed at its path, which takes its listening sockets
// and tunnels over (POST /sandbox/upgrade on the admin API).
func upgradeCommand() *cobra.Command {
	var address, config, adapter string
	cmd := &cobra.Command{
		Use:   "upgrade [--address <admin>] [--config <file> [--adapter <name>]]",
		Short: "Replace the running forwarder by the installed binary without dropping a tunnel",
		Long: `
Asks the running Caddy (through its admin API) to start the binary now
installed at its path, with its own arguments. The new process takes the
listening sockets (tcp-handoff listeners), the activity reports, the replay
caches and every tunnel whose gateway session runs in kernel TLS; the old
process then exits, letting the tunnels that could not move (userspace TLS)
drain for drain_grace_period. Needs the sandbox_handoff global option (or
app) in the configuration. Prints what moved as JSON; exits non-zero if
the new process did not take over (the running one then serves on).

The admin address is found as "caddy reload" finds it: --address, else the
configuration's admin listener (--config), else localhost:2019.

The steps, and what each process logs:
https://github.com/ktlsingress/caddy-ktls/blob/main/docs/deploy.md#upgrading-without-dropping-a-tunnel
`,
		Args: cobra.NoArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			admin, err := caddycmd.DetermineAdminAPIAddress(address, nil, config, adapter)
			if err != nil {
				return fmt.Errorf("the admin API's address: %w", err)
			}
			resp, err := caddycmd.AdminAPIRequest(admin, http.MethodPost, "/sandbox/upgrade", nil, nil)
			if err != nil {
				return fmt.Errorf("the upgrade: %w", err)
			}
			defer resp.Body.Close()
			body, err := io.ReadAll(resp.Body)
			if err != nil {
				return err
			}
			if resp.StatusCode != http.StatusOK {
				return errors.New(string(body))
			}
			_, err = cmd.OutOrStdout().Write(body)
			return err
		},
	}
	cmd.Flags().StringVar(&address, "address", "", "the admin API's address")
	cmd.Flags().StringVarP(&config, "config", "c", "", "the configuration file that names the admin address")
	cmd.Flags().StringVarP(&adapter, "adapter", "a", "", "the configuration file's adapter")
	return cmd
}
