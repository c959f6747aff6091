// kubeletpeer plays the kubelet's side of the device plugin API v1beta1 for tests, using the
// upstream generated API package, so the plugin is exercised by the same wire code kubelet runs.
//
// It serves Registration on <dir>/kubelet.sock (after removing stale sockets there, as kubelet
// does at start-up), accepts Register, dials the plugin's endpoint, calls
// GetDevicePluginOptions and streams ListAndWatch. A test drives it with JSON lines on stdin and
// reads JSON lines on stdout: command results carry the command's "id", asynchronous happenings
// carry "event". It exits when stdin closes, so it never outlives the test that started it.
package main

import (
	"bufio"
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"net"
	"os"
	"os/signal"
	"path/filepath"
	"sort"
	"strings"
	"sync"
	"syscall"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	api "k8s.io/kubelet/pkg/apis/deviceplugin/v1beta1"
)

type output struct {
	mu  sync.Mutex
	enc *json.Encoder
}

func (o *output) emit(v map[string]any) {
	o.mu.Lock()
	defer o.mu.Unlock()
	_ = o.enc.Encode(v)
}

type device struct {
	ID     string `json:"id"`
	Health string `json:"health"`
}

type plugin struct {
	resource string
	endpoint string
	conn     *grpc.ClientConn
	client   api.DevicePluginClient
	options  *api.DevicePluginOptions
	cancel   context.CancelFunc
	devices  []device
	// Ids this peer handed to containers, like kubelet's podDevices: never offered again.
	allocated map[string]bool
}

type peer struct {
	api.UnimplementedRegistrationServer
	dir     string
	out     *output
	mu      sync.Mutex
	plugins map[string]*plugin
}

func (p *peer) Register(ctx context.Context, r *api.RegisterRequest) (*api.Empty, error) {
	p.out.emit(map[string]any{"event": "register", "resource": r.ResourceName,
		"endpoint": r.Endpoint, "version": r.Version})
	if !supported(r.Version) {
		return &api.Empty{}, fmt.Errorf("unsupported device plugin API version %q (kubelet supports %v)",
			r.Version, api.SupportedVersions)
	}
	if !strings.Contains(r.ResourceName, "/") || strings.HasPrefix(r.ResourceName, "kubernetes.io/") {
		return &api.Empty{}, fmt.Errorf("invalid extended resource name %q", r.ResourceName)
	}
	// Like kubelet: dial the endpoint and read the options before answering, so a plugin that
	// registers before serving is refused.
	dialCtx, cancelDial := context.WithTimeout(ctx, 10*time.Second)
	defer cancelDial()
	socket := filepath.Join(p.dir, r.Endpoint)
	conn, err := grpc.DialContext(dialCtx, socket,
		grpc.WithAuthority("localhost"),
		grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithBlock(),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}),
	)
	if err != nil {
		p.out.emit(map[string]any{"event": "register-failed", "resource": r.ResourceName, "error": err.Error()})
		return &api.Empty{}, fmt.Errorf("failed to dial device plugin: %v", err)
	}
	client := api.NewDevicePluginClient(conn)
	options, err := client.GetDevicePluginOptions(ctx, &api.Empty{})
	if err != nil {
		conn.Close()
		p.out.emit(map[string]any{"event": "register-failed", "resource": r.ResourceName, "error": err.Error()})
		return &api.Empty{}, fmt.Errorf("failed to get device plugin options: %v", err)
	}
	streamCtx, cancel := context.WithCancel(context.Background())
	pl := &plugin{resource: r.ResourceName, endpoint: r.Endpoint, conn: conn, client: client,
		options: options, cancel: cancel, allocated: map[string]bool{}}
	p.mu.Lock()
	if old := p.plugins[r.ResourceName]; old != nil {
		old.cancel()
		old.conn.Close()
		for id := range old.allocated {
			pl.allocated[id] = true
		}
	}
	p.plugins[r.ResourceName] = pl
	p.mu.Unlock()
	p.out.emit(map[string]any{"event": "registered", "resource": r.ResourceName, "endpoint": r.Endpoint,
		"pre_start_required":                 options.PreStartRequired,
		"get_preferred_allocation_available": options.GetPreferredAllocationAvailable})
	go p.listAndWatch(streamCtx, pl)
	return &api.Empty{}, nil
}

func (p *peer) listAndWatch(ctx context.Context, pl *plugin) {
	stream, err := pl.client.ListAndWatch(ctx, &api.Empty{})
	if err != nil {
		p.out.emit(map[string]any{"event": "stream-ended", "resource": pl.resource, "error": err.Error()})
		return
	}
	for {
		response, err := stream.Recv()
		if err != nil {
			p.out.emit(map[string]any{"event": "stream-ended", "resource": pl.resource, "error": err.Error()})
			return
		}
		devices := make([]device, 0, len(response.Devices))
		for _, d := range response.Devices {
			devices = append(devices, device{ID: d.ID, Health: d.Health})
		}
		p.mu.Lock()
		pl.devices = devices
		p.mu.Unlock()
		p.out.emit(map[string]any{"event": "devices", "resource": pl.resource, "devices": devices})
	}
}

func supported(version string) bool {
	for _, v := range api.SupportedVersions {
		if v == version {
			return true
		}
	}
	return false
}

type command struct {
	ID          int        `json:"id"`
	Op          string     `json:"op"`
	Resource    string     `json:"resource"`
	Available   []string   `json:"available"`
	MustInclude []string   `json:"must_include"`
	Size        int32      `json:"size"`
	Containers  [][]string `json:"containers"`
	IDs         []string   `json:"ids"`
}

func (p *peer) plugin(resource string) (*plugin, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	pl := p.plugins[resource]
	if pl == nil {
		return nil, fmt.Errorf("no device plugin registered for %s", resource)
	}
	return pl, nil
}

func allocateResult(r *api.ContainerAllocateResponse) map[string]any {
	devices := []map[string]string{}
	for _, d := range r.Devices {
		devices = append(devices, map[string]string{"container_path": d.ContainerPath,
			"host_path": d.HostPath, "permissions": d.Permissions})
	}
	mounts := []map[string]any{}
	for _, m := range r.Mounts {
		mounts = append(mounts, map[string]any{"container_path": m.ContainerPath,
			"host_path": m.HostPath, "read_only": m.ReadOnly})
	}
	envs := map[string]string{}
	for k, v := range r.Envs {
		envs[k] = v
	}
	annotations := map[string]string{}
	for k, v := range r.Annotations {
		annotations[k] = v
	}
	return map[string]any{"envs": envs, "devices": devices, "mounts": mounts, "annotations": annotations}
}

func (p *peer) allocate(ctx context.Context, pl *plugin, containers [][]string) ([]map[string]any, error) {
	request := &api.AllocateRequest{}
	for _, ids := range containers {
		request.ContainerRequests = append(request.ContainerRequests, &api.ContainerAllocateRequest{DevicesIds: ids})
	}
	response, err := pl.client.Allocate(ctx, request)
	if err != nil {
		return nil, err
	}
	results := []map[string]any{}
	for _, r := range response.ContainerResponses {
		results = append(results, allocateResult(r))
	}
	return results, nil
}

// admit does what kubelet's device manager does for one container needing `size` devices:
// offer the healthy ids not already handed out, follow the plugin's preference when it is a
// valid choice, then Allocate.
func (p *peer) admit(ctx context.Context, pl *plugin, size int, mustInclude []string) (map[string]any, error) {
	p.mu.Lock()
	available := []string{}
	for _, d := range pl.devices {
		if d.Health == api.Healthy && !pl.allocated[d.ID] {
			available = append(available, d.ID)
		}
	}
	p.mu.Unlock()
	if len(available) < size {
		return nil, fmt.Errorf("requested number of devices unavailable for %s. Requested: %d, Available: %d",
			pl.resource, size, len(available))
	}
	chosen := []string{}
	preferred := []string{}
	if pl.options.GetPreferredAllocationAvailable {
		response, err := pl.client.GetPreferredAllocation(ctx, &api.PreferredAllocationRequest{
			ContainerRequests: []*api.ContainerPreferredAllocationRequest{{
				AvailableDeviceIDs: available, MustIncludeDeviceIDs: mustInclude, AllocationSize: int32(size)}}})
		if err != nil {
			return nil, fmt.Errorf("GetPreferredAllocation: %v", err)
		}
		if len(response.ContainerResponses) > 0 {
			preferred = response.ContainerResponses[0].DeviceIDs
		}
	}
	offered := map[string]bool{}
	for _, id := range available {
		offered[id] = true
	}
	for _, id := range preferred {
		if offered[id] && len(chosen) < size {
			chosen = append(chosen, id)
			delete(offered, id)
		}
	}
	for _, id := range available {
		if offered[id] && len(chosen) < size {
			chosen = append(chosen, id)
		}
	}
	results, err := p.allocate(ctx, pl, [][]string{chosen})
	if err != nil {
		return nil, err
	}
	p.mu.Lock()
	for _, id := range chosen {
		pl.allocated[id] = true
	}
	p.mu.Unlock()
	return map[string]any{"preferred": preferred, "ids": chosen, "response": results[0]}, nil
}

func (p *peer) handle(ctx context.Context, c command) map[string]any {
	result := map[string]any{"id": c.ID}
	fail := func(err error) map[string]any {
		result["error"] = err.Error()
		return result
	}
	if c.Op == "ping" {
		result["ok"] = true
		return result
	}
	pl, err := p.plugin(c.Resource)
	if err != nil {
		return fail(err)
	}
	callCtx, cancel := context.WithTimeout(ctx, 60*time.Second)
	defer cancel()
	switch c.Op {
	case "options":
		options, err := pl.client.GetDevicePluginOptions(callCtx, &api.Empty{})
		if err != nil {
			return fail(err)
		}
		result["pre_start_required"] = options.PreStartRequired
		result["get_preferred_allocation_available"] = options.GetPreferredAllocationAvailable
	case "devices":
		p.mu.Lock()
		result["devices"] = append([]device{}, pl.devices...)
		p.mu.Unlock()
	case "preferred":
		response, err := pl.client.GetPreferredAllocation(callCtx, &api.PreferredAllocationRequest{
			ContainerRequests: []*api.ContainerPreferredAllocationRequest{{
				AvailableDeviceIDs: c.Available, MustIncludeDeviceIDs: c.MustInclude, AllocationSize: c.Size}}})
		if err != nil {
			return fail(err)
		}
		ids := []string{}
		if len(response.ContainerResponses) > 0 {
			ids = response.ContainerResponses[0].DeviceIDs
		}
		result["ids"] = ids
	case "allocate":
		results, err := p.allocate(callCtx, pl, c.Containers)
		if err != nil {
			return fail(err)
		}
		result["responses"] = results
	case "admit":
		admitted, err := p.admit(callCtx, pl, int(c.Size), c.MustInclude)
		if err != nil {
			return fail(err)
		}
		for k, v := range admitted {
			result[k] = v
		}
	case "release":
		p.mu.Lock()
		for _, id := range c.IDs {
			delete(pl.allocated, id)
		}
		p.mu.Unlock()
	case "prestart":
		if _, err := pl.client.PreStartContainer(callCtx, &api.PreStartContainerRequest{DevicesIds: c.IDs}); err != nil {
			return fail(err)
		}
	default:
		return fail(fmt.Errorf("unknown op %q", c.Op))
	}
	return result
}

// cleanSockets removes every socket in dir, as kubelet's device manager does when it starts:
// plugins must notice the new kubelet.sock, serve again and register again.
func cleanSockets(dir string) error {
	entries, err := os.ReadDir(dir)
	if err != nil {
		return err
	}
	var errs []error
	for _, e := range entries {
		path := filepath.Join(dir, e.Name())
		info, err := os.Stat(path)
		if err != nil || info.IsDir() || info.Mode()&os.ModeSocket == 0 {
			continue
		}
		if err := os.Remove(path); err != nil {
			errs = append(errs, err)
		}
	}
	return errors.Join(errs...)
}

func main() {
	dir := flag.String("dir", "", "device plugin directory (kubelet.sock is created here)")
	clean := flag.Bool("clean", true, "remove existing sockets in -dir first, as kubelet does")
	flag.Parse()
	if *dir == "" {
		fmt.Fprintln(os.Stderr, "kubeletpeer: -dir is required")
		os.Exit(2)
	}
	out := &output{enc: json.NewEncoder(os.Stdout)}
	if err := os.MkdirAll(*dir, 0o750); err != nil {
		fmt.Fprintln(os.Stderr, "kubeletpeer:", err)
		os.Exit(1)
	}
	if *clean {
		if err := cleanSockets(*dir); err != nil {
			fmt.Fprintln(os.Stderr, "kubeletpeer: cleaning", *dir, ":", err)
			os.Exit(1)
		}
	}
	socket := filepath.Join(*dir, "kubelet.sock")
	_ = os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	if err != nil {
		fmt.Fprintln(os.Stderr, "kubeletpeer:", err)
		os.Exit(1)
	}
	p := &peer{dir: *dir, out: out, plugins: map[string]*plugin{}}
	server := grpc.NewServer()
	api.RegisterRegistrationServer(server, p)
	go func() {
		if err := server.Serve(listener); err != nil {
			fmt.Fprintln(os.Stderr, "kubeletpeer: serve:", err)
		}
	}()
	out.emit(map[string]any{"event": "listening", "socket": socket})

	ctx, stop := signal.NotifyContext(context.Background(), syscall.SIGTERM, syscall.SIGINT)
	defer stop()
	lines := make(chan string)
	go func() {
		scanner := bufio.NewScanner(os.Stdin)
		scanner.Buffer(make([]byte, 1<<20), 1<<20)
		for scanner.Scan() {
			lines <- scanner.Text()
		}
		close(lines)
	}()
	for running := true; running; {
		select {
		case <-ctx.Done():
			running = false
		case line, ok := <-lines:
			if !ok {
				running = false
				break
			}
			if strings.TrimSpace(line) == "" {
				continue
			}
			var c command
			if err := json.Unmarshal([]byte(line), &c); err != nil {
				out.emit(map[string]any{"event": "bad-command", "error": err.Error(), "line": line})
				continue
			}
			out.emit(p.handle(ctx, c))
		}
	}
	// Like a kubelet that stops: the registration server goes away and its connections to the
	// plugins close.
	server.Stop()
	p.mu.Lock()
	names := make([]string, 0, len(p.plugins))
	for name, pl := range p.plugins {
		pl.cancel()
		pl.conn.Close()
		names = append(names, name)
	}
	p.mu.Unlock()
	sort.Strings(names)
	out.emit(map[string]any{"event": "stopped", "plugins": names})
}
