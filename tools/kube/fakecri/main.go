// Command fakecri serves the upstream fake container runtime (k8s.io/cri-client/pkg/fake, the
// one kubemark's hollow nodes run) over CRI on a unix socket, so a real kubelet can start pods
// on a machine without a container engine. Nothing runs: containers are entries in a map.
//
// Two additions to the upstream fake:
//   - Every CreateContainer request is printed on stdout as one JSON line (pod, container,
//     environment, device specs, mounts): the upstream fake keeps none of them, and they are
//     what a device plugin's Allocate answer becomes.
//   - Each container gets a log file, as a real runtime's does. The upstream fake leaves
//     ContainerStatus.LogPath empty, and kubelet removes `LogPath + "*"` when it deletes a
//     container: with an empty path that glob matches every file in kubelet's working directory.
//     A request that would leave the path empty is refused instead.
//   - A container whose command is `true` exits with code 0 as soon as it starts, so init
//     containers can complete (upstream fake containers run until stopped).
//   - Pulled images have a size: kubelet refuses an image whose id or size is unset, which with
//     the upstream fake (size 0) fails every pod whose image is not re-pulled each time.
//
// Usage: fakecri -endpoint unix:///path/to/cri.sock
package main

import (
	"context"
	"encoding/json"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	runtimeapi "k8s.io/cri-api/pkg/apis/runtime/v1"
	"k8s.io/cri-client/pkg/fake"
)

type podRef struct {
	Name      string `json:"name"`
	Namespace string `json:"namespace"`
	UID       string `json:"uid"`
}

type deviceSpec struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	Permissions   string `json:"permissions"`
}

type mountSpec struct {
	ContainerPath string `json:"container_path"`
	HostPath      string `json:"host_path"`
	ReadOnly      bool   `json:"readonly"`
}

// created is the line printed for each CreateContainer.
type created struct {
	Call        string            `json:"call"`
	Pod         podRef            `json:"pod"`
	Container   string            `json:"container"`
	ContainerID string            `json:"container_id"`
	Image       string            `json:"image"`
	Command     []string          `json:"command"`
	Envs        map[string]string `json:"envs"`
	Devices     []deviceSpec      `json:"devices"`
	Mounts      []mountSpec       `json:"mounts"`
	LogPath     string            `json:"log_path"`
}

type runtime struct {
	fake *fake.RemoteRuntime
	mu   sync.Mutex // guards out and exiting
	out  *json.Encoder
	// Containers to stop at once when started: their command is `true`.
	exiting map[string]bool
}

func (r *runtime) intercept(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
	switch req := req.(type) {
	case *runtimeapi.CreateContainerRequest:
		return r.create(ctx, req, handler)
	case *runtimeapi.StartContainerRequest:
		resp, err := handler(ctx, req)
		if err == nil {
			r.exitIfDone(req.GetContainerId())
		}
		return resp, err
	}
	return handler(ctx, req)
}

func (r *runtime) exitIfDone(id string) {
	r.mu.Lock()
	exits := r.exiting[id]
	delete(r.exiting, id)
	r.mu.Unlock()
	if !exits {
		return
	}
	service := r.fake.RuntimeService
	service.Lock()
	defer service.Unlock()
	if c, found := service.Containers[id]; found {
		c.State = runtimeapi.ContainerState_CONTAINER_EXITED
		c.FinishedAt = time.Now().UnixNano()
		c.ExitCode = 0
		c.Reason = "Completed"
	}
}

func (r *runtime) create(ctx context.Context, create *runtimeapi.CreateContainerRequest, handler grpc.UnaryHandler) (any, error) {
	logDir := create.GetSandboxConfig().GetLogDirectory()
	logName := create.GetConfig().GetLogPath()
	if !filepath.IsAbs(logDir) || logName == "" || filepath.IsAbs(logName) || strings.Contains(logName, "..") {
		return nil, status.Errorf(codes.InvalidArgument,
			"fakecri: container log path %q in %q is unusable; refusing rather than let "+
				"kubelet's log cleanup glob its working directory", logName, logDir)
	}
	logPath := filepath.Join(logDir, logName)
	if err := os.MkdirAll(filepath.Dir(logPath), 0o755); err != nil {
		return nil, status.Errorf(codes.Internal, "fakecri: %v", err)
	}
	if err := os.WriteFile(logPath, nil, 0o644); err != nil {
		return nil, status.Errorf(codes.Internal, "fakecri: %v", err)
	}
	resp, err := handler(ctx, create)
	if err != nil {
		return resp, err
	}
	id := resp.(*runtimeapi.CreateContainerResponse).GetContainerId()
	service := r.fake.RuntimeService
	service.Lock()
	if c, found := service.Containers[id]; found {
		c.LogPath = logPath
	}
	service.Unlock()
	if command := create.GetConfig().GetCommand(); len(command) == 1 && filepath.Base(command[0]) == "true" {
		r.mu.Lock()
		r.exiting[id] = true
		r.mu.Unlock()
	}
	r.print(create, id, logPath)
	return resp, nil
}

func (r *runtime) print(req *runtimeapi.CreateContainerRequest, id, logPath string) {
	config := req.GetConfig()
	meta := req.GetSandboxConfig().GetMetadata()
	line := created{
		Call:        "CreateContainer",
		Pod:         podRef{meta.GetName(), meta.GetNamespace(), meta.GetUid()},
		Container:   config.GetMetadata().GetName(),
		ContainerID: id,
		Image:       config.GetImage().GetImage(),
		Command:     config.GetCommand(),
		Envs:        map[string]string{},
		Devices:     []deviceSpec{},
		Mounts:      []mountSpec{},
		LogPath:     logPath,
	}
	for _, e := range config.GetEnvs() {
		line.Envs[e.GetKey()] = string(e.GetValue())
	}
	for _, d := range config.GetDevices() {
		line.Devices = append(line.Devices, deviceSpec{d.GetContainerPath(), d.GetHostPath(), d.GetPermissions()})
	}
	for _, m := range config.GetMounts() {
		line.Mounts = append(line.Mounts, mountSpec{m.GetContainerPath(), m.GetHostPath(), m.GetReadonly()})
	}
	r.mu.Lock()
	defer r.mu.Unlock()
	_ = r.out.Encode(line)
}

func main() {
	endpoint := flag.String("endpoint", "", "unix:///path/to/cri.sock to serve on")
	flag.Parse()
	path, found := strings.CutPrefix(*endpoint, "unix://")
	if !found || path == "" {
		fmt.Fprintln(os.Stderr, "fakecri: -endpoint unix:///path is required")
		os.Exit(2)
	}
	if err := os.Remove(path); err != nil && !os.IsNotExist(err) {
		fmt.Fprintf(os.Stderr, "fakecri: %v\n", err)
		os.Exit(1)
	}
	listener, err := net.Listen("unix", path)
	if err != nil {
		fmt.Fprintf(os.Stderr, "fakecri: %v\n", err)
		os.Exit(1)
	}

	r := &runtime{fake: fake.NewFakeRemoteRuntime(), out: json.NewEncoder(os.Stdout), exiting: map[string]bool{}}
	// What fake.Start does besides serving: the runtime and its network report ready.
	r.fake.RuntimeService.FakeStatus = &runtimeapi.RuntimeStatus{Conditions: []*runtimeapi.RuntimeCondition{
		{Type: runtimeapi.RuntimeReady, Status: true},
		{Type: runtimeapi.NetworkReady, Status: true},
	}}
	r.fake.ImageService.SetFakeImageSize(1 << 20)
	// Our own server, since the fake's has no interceptor.
	server := grpc.NewServer(grpc.UnaryInterceptor(r.intercept))
	runtimeapi.RegisterRuntimeServiceServer(server, r.fake)
	runtimeapi.RegisterImageServiceServer(server, r.fake)

	stop := make(chan os.Signal, 1)
	signal.Notify(stop, syscall.SIGTERM, syscall.SIGINT)
	go func() {
		<-stop
		server.Stop()
	}()
	fmt.Fprintf(os.Stderr, "fakecri: serving on %s\n", path)
	if err := server.Serve(listener); err != nil {
		fmt.Fprintf(os.Stderr, "fakecri: %v\n", err)
		os.Exit(1)
	}
}
