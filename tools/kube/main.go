// Command kubebin is a multi-call binary holding the Kubernetes components the
// neuron-scheduler tests run on 127.0.0.1: one build, one cache entry, instead
// of five separately vendored binaries. The kubelet is here so the device plugin
// can be tested against the real device manager (with the fake CRI runtime in
// ./fakecri, built by tools/kube.mk next to this binary). kube-controller-manager
// is here so that Deployments recreate the pods consolidation evicts and the
// disruption controller keeps PodDisruptionBudgets' status current.
//
// Usage: kubebin <kube-apiserver|kube-controller-manager|kube-scheduler|etcd|kubectl|kubelet> [flags...]
// or invoke it through a symlink named after the component.
//
// The same source builds every minor version tools/kube.mk pins (go.mod, compat/1.X.mod): where
// an upstream constructor changed between them, it is called the way the version at hand
// defines it (newKubeletCommand, logVerbosity).
package main

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"sort"
	"strings"
	_ "time/tzdata" // kube-apiserver needs it for CronJob time zones

	"github.com/spf13/cobra"
	"go.etcd.io/etcd/server/v3/etcdmain"
	"k8s.io/component-base/cli"
	"k8s.io/component-base/logs"
	_ "k8s.io/component-base/logs/json/register"
	_ "k8s.io/component-base/metrics/prometheus/clientgo"
	_ "k8s.io/component-base/metrics/prometheus/version"
	kubectlcmd "k8s.io/kubectl/pkg/cmd"
	kubectlutil "k8s.io/kubectl/pkg/cmd/util"
	apiserver "k8s.io/kubernetes/cmd/kube-apiserver/app"
	controllermanager "k8s.io/kubernetes/cmd/kube-controller-manager/app"
	scheduler "k8s.io/kubernetes/cmd/kube-scheduler/app"
	kubelet "k8s.io/kubernetes/cmd/kubelet/app"

	_ "k8s.io/client-go/plugin/pkg/client/auth"
)

var components = map[string]func() int{
	"kube-apiserver": func() int { return cli.Run(apiserver.NewAPIServerCommand()) },
	"kube-controller-manager": func() int {
		return cli.Run(controllermanager.NewControllerManagerCommand())
	},
	"kube-scheduler": func() int { return cli.Run(scheduler.NewSchedulerCommand()) },
	"kubelet":        func() int { return cli.Run(newKubeletCommand()) },
	"etcd": func() int {
		etcdmain.Main(os.Args)
		return 0
	},
	"kubectl": func() int {
		// Same as upstream cmd/kubectl: verbosity must be known before the
		// command is built, because building it already logs.
		logs.GlogSetter(logVerbosity(os.Args)) //nolint:errcheck
		if err := cli.RunNoErrOutput(kubectlcmd.NewDefaultKubectlCommand()); err != nil {
			kubectlutil.CheckErr(err)
		}
		return 0
	},
}

// newKubeletCommand builds the kubelet's command: 1.34 and later take a context, 1.32 and 1.33
// nothing.
func newKubeletCommand() *cobra.Command {
	build := reflect.ValueOf(kubelet.NewKubeletCommand)
	var args []reflect.Value
	if build.Type().NumIn() == 1 {
		args = append(args, reflect.ValueOf(context.Background()))
	}
	return build.Call(args)[0].Interface().(*cobra.Command)
}

// logVerbosity is kubectl's own reading of -v before its command is built (cmd.GetLogVerbosity,
// 1.34 and later; earlier cmd/kubectl did without it).
func logVerbosity(args []string) string {
	for i, arg := range args {
		if arg == "--" {
			break
		}
		if arg == "--v" || arg == "-v" {
			if i+1 < len(args) {
				return args[i+1]
			}
		} else if strings.Contains(arg, "--v=") || strings.Contains(arg, "-v=") {
			if parts := strings.Split(arg, "="); len(parts) > 1 && parts[1] != "" {
				return parts[1]
			}
		}
	}
	return "0"
}

func main() {
	name := filepath.Base(os.Args[0])
	if _, ok := components[name]; !ok && len(os.Args) > 1 {
		// Multi-call form: drop our own name so each component sees the
		// os.Args it would see as a standalone binary (kubectl and etcd read
		// os.Args directly, not only through cobra).
		name = os.Args[1]
		os.Args = append([]string{name}, os.Args[2:]...)
	}
	run, ok := components[name]
	if !ok {
		names := make([]string, 0, len(components))
		for n := range components {
			names = append(names, n)
		}
		sort.Strings(names)
		fmt.Fprintf(os.Stderr, "usage: %s <%s> [args...]\n", filepath.Base(os.Args[0]), strings.Join(names, "|"))
		os.Exit(2)
	}
	os.Exit(run())
}
