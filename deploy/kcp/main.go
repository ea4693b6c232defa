// Command kcp is kcp's server, `kcp start` with all of kcp's flags, built
// from kcp with the webhook seam of docs/kcp/webhook-tunnel.patch, the seam
// filled by kcpplugin: webhook configurations and CRD conversion webhooks
// that name a Service are called through the tunnel broker, with TLS end to
// end, for the logical cluster that owns them. The --tunnel-* flags
// configure it; without --tunnel-broker it is kcp as released.
//
// It builds only against the patched kcp (deploy/kcp/build.sh, make
// images): the seam's ExtraOptions field is not in kcp's releases.
package main

import (
	"os"
	"strings"

	"github.com/spf13/cobra"

	utilerrors "k8s.io/apimachinery/pkg/util/errors"
	genericapiserver "k8s.io/apiserver/pkg/server"
	"k8s.io/client-go/rest"
	"k8s.io/component-base/cli"
	cliflag "k8s.io/component-base/cli/flag"
	"k8s.io/component-base/cli/globalflag"
	"k8s.io/component-base/logs"
	logsapiv1 "k8s.io/component-base/logs/api/v1"
	"k8s.io/component-base/term"
	"k8s.io/component-base/version"
	"k8s.io/klog/v2"

	"github.com/kcp-dev/embeddedetcd"
	"github.com/kcp-dev/kcp/cmd/kcp/options"
	kcpfeatures "github.com/kcp-dev/kcp/pkg/features"
	"github.com/kcp-dev/kcp/pkg/server"

	"github.com/kcp-dev/tunnel-broker/deploy/kcp/tunnel"

	_ "k8s.io/component-base/logs/json/register"
)

func main() {
	cmd := &cobra.Command{
		Use:           "kcp",
		Short:         "kcp, calling webhook Services through the tunnel broker",
		SilenceUsage:  true,
		SilenceErrors: true,
	}

	// kcp's defaults depend on these two flags, so kcp reads them before
	// its flags are parsed; so does this program.
	kcpOptions := options.NewOptions(argValue(os.Args, "--root-directory", ".kcp"))
	kcpOptions.Server.GenericControlPlane.Logs.Verbosity = logsapiv1.VerbosityLevel(2)
	kcpOptions.Server.Extra.AdditionalMappingsFile = argValue(os.Args, "--miniproxy-mapping-file", "")
	tunnelOptions := tunnel.NewOptions()

	startCmd := &cobra.Command{
		Use:   "start",
		Short: "Start the control plane process",
		Long: "Start kcp's control plane process, as 'kcp start' does. With --tunnel-broker, " +
			"webhooks and conversion webhooks that name a Service are called through the tunnel broker.",
		PersistentPreRunE: func(*cobra.Command, []string) error {
			// The loopback clients should not log warnings kcp gives itself.
			rest.SetDefaultWarningHandler(rest.NoWarnings{})
			return nil
		},
		RunE: func(cmd *cobra.Command, _ []string) error {
			// Before anything logs: gRPC starts logging through klog early.
			if err := logsapiv1.ValidateAndApply(kcpOptions.Server.GenericControlPlane.Logs, kcpfeatures.DefaultFeatureGate); err != nil {
				return err
			}
			if errs := tunnelOptions.Validate(); len(errs) > 0 {
				return utilerrors.NewAggregate(errs)
			}
			ctx := genericapiserver.SetupSignalContext()

			// kcp's SVID is in hand before kcp serves a request that could
			// call a webhook; the broker is dialed at the first such call.
			wrapper, closeTunnel, err := tunnelOptions.Start(ctx, klog.FromContext(ctx))
			if err != nil {
				return err
			}
			defer closeTunnel()
			kcpOptions.Server.Extra.WebhookAuthenticationInfoResolverWrapper = wrapper

			completed, err := kcpOptions.Complete(ctx)
			if err != nil {
				return err
			}
			if errs := completed.Validate(); len(errs) > 0 {
				return utilerrors.NewAggregate(errs)
			}
			klog.FromContext(ctx).Info("running with selected batteries", "batteries", strings.Join(completed.Server.Extra.BatteriesIncluded, ","))

			serverConfig, err := server.NewConfig(ctx, completed.Server)
			if err != nil {
				return err
			}
			completedConfig, err := serverConfig.Complete()
			if err != nil {
				return err
			}
			// Storage decorators reach etcd as the server is made: etcd first.
			if completedConfig.EmbeddedEtcd.Config != nil {
				if err := embeddedetcd.NewServer(completedConfig.EmbeddedEtcd).Run(ctx); err != nil {
					return err
				}
			}
			s, err := server.NewServer(completedConfig)
			if err != nil {
				return err
			}
			return s.Run(ctx)
		},
	}

	fss := cliflag.NamedFlagSets{}
	kcpOptions.AddFlags(&fss)
	tunnelOptions.AddFlags(fss.FlagSet("tunnel broker"))
	globalflag.AddGlobalFlags(fss.FlagSet("global"), cmd.Name(), logs.SkipLoggingConfigurationFlags())
	for _, f := range fss.FlagSets {
		startCmd.Flags().AddFlagSet(f)
	}
	cols, _, _ := term.TerminalSize(cmd.OutOrStdout())
	cliflag.SetUsageAndHelpFunc(startCmd, fss, cols)
	cmd.AddCommand(startCmd)

	cmd.Version = version.Get().String()
	if cmd.Version == "" {
		cmd.Version = "<unknown>"
	}
	os.Exit(cli.Run(cmd))
}

// argValue returns the value of flag name in args, in either form
// (--name value, --name=value), or def.
func argValue(args []string, name, def string) string {
	for i, a := range args {
		if a == name && i+1 < len(args) {
			return args[i+1]
		}
		if v, ok := strings.CutPrefix(a, name+"="); ok {
			return v
		}
	}
	return def
}
