package offload

import (
	"math"
	"strconv"

	"github.com/caddyserver/caddy/v2/caddyconfig/caddyfile"
	"github.com/ktlsingress/caddy-ktls/internal/caddyfileargs"
)

// UnmarshalCaddyfileOption reads the offload option d is on, if it is one,
// and reports whether it was. The offload options, the same in the layer4
// `ktls` handler and the `ktls` listener wrapper:
//
//	offload           on|off        # default on; off keeps the whole session in userspace TLS
//	rx                on|off        # default on; off keeps decryption in Go (kTLS RX is where CVEs cluster)
//	fallback          allow|refuse  # default allow: userspace TLS when offload is impossible
//	expect_no_pad                   # TLS_RX_EXPECT_NO_PAD (trusted peers only)
//	tx_zerocopy_ro                  # TLS_TX_ZEROCOPY_RO (with the wrapper's sendfile, device offload)
//	keyupdate_rate    <per_second> [<burst>]
//	key_record_limit  <records>     # default 8388608 (2^23), at most 2^24: renew the key, or end, before a key protects more
//	handshake_timeout <duration>
func (o *Options) UnmarshalCaddyfileOption(d *caddyfile.Dispenser) (handled bool, err error) {
	switch opt := d.Val(); opt {
	case "offload":
		v, err := caddyfileargs.OneOf(d, "on", "off")
		if err != nil {
			return true, err
		}
		o.DisableOffload = v == "off"
	case "rx":
		v, err := caddyfileargs.OneOf(d, "on", "off")
		if err != nil {
			return true, err
		}
		o.DisableRX = v == "off"
	case "fallback":
		v, err := caddyfileargs.OneOf(d, "allow", "refuse")
		if err != nil {
			return true, err
		}
		o.RequireOffload = v == "refuse"
	case "expect_no_pad":
		if err := caddyfileargs.NoArgs(d); err != nil {
			return true, err
		}
		o.ExpectNoPad = true
	case "tx_zerocopy_ro":
		if err := caddyfileargs.NoArgs(d); err != nil {
			return true, err
		}
		o.TXZeroCopyRO = true
	case "keyupdate_rate":
		args := d.RemainingArgs()
		if len(args) < 1 || len(args) > 2 {
			return true, d.Errf("keyupdate_rate takes a rate per second and an optional burst, got %d arguments", len(args))
		}
		rate, err := strconv.ParseFloat(args[0], 64)
		// ParseFloat takes "NaN" and "Inf", which JSON cannot carry.
		if err != nil || !(rate > 0) || math.IsInf(rate, 1) {
			return true, d.Errf("keyupdate_rate: %q is not a positive number", args[0])
		}
		o.KeyUpdateRate = rate
		if len(args) == 2 {
			burst, err := strconv.Atoi(args[1])
			if err != nil || burst <= 0 {
				return true, d.Errf("keyupdate_rate: burst %q is not a positive integer", args[1])
			}
			o.KeyUpdateBurst = burst
		}
	case "key_record_limit":
		if !d.NextArg() {
			return true, d.ArgErr()
		}
		n, err := strconv.ParseUint(d.Val(), 10, 64)
		if err != nil || n == 0 {
			return true, d.Errf("key_record_limit: %q is not a positive integer", d.Val())
		}
		o.KeyRecordLimit = n
		if d.NextArg() {
			return true, d.ArgErr()
		}
	case "handshake_timeout":
		dur, err := caddyfileargs.Duration(d)
		if err != nil {
			return true, err
		}
		o.HandshakeTimeout = dur
	default:
		return false, nil
	}
	return true, nil
}
