// Command karpenter-kwok is Karpenter's kwok cloud provider (sigs.k8s.io/karpenter/kwok/main.go)
// with one step added: the instance types get the ResourceSliceTemplates named by
// NEURON_SLICE_TEMPLATES, a JSON file {instance type: [resource.k8s.io/v1 ResourceSliceSpec, ...]}
// written by `neuron-scheduler dra slice-templates` (our own slice code, dra/slices.py). The
// kwok provider and AWS's provider give none (aws/karpenter-provider-aws#9519), so without this
// Karpenter cannot simulate a new node's DRA devices.
//
// Test tooling only (tests/e2e/test_autoscaling.py): never shipped. Without the variable it runs
// exactly as the kwok provider's own main.
package main

import (
	"encoding/json"
	"fmt"
	"os"
	"unique"

	"github.com/samber/lo"
	resourcev1 "k8s.io/api/resource/v1"
	"sigs.k8s.io/controller-runtime/pkg/log"

	kwok "sigs.k8s.io/karpenter/kwok/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/cloudprovider"
	"sigs.k8s.io/karpenter/pkg/cloudprovider/overlay"
	"sigs.k8s.io/karpenter/pkg/controllers"
	"sigs.k8s.io/karpenter/pkg/controllers/node/health"
	"sigs.k8s.io/karpenter/pkg/controllers/state"
	"sigs.k8s.io/karpenter/pkg/operator"
)

const templatesEnv = "NEURON_SLICE_TEMPLATES"

func main() {
	ctx, op := operator.NewOperator()
	instanceTypes, err := kwok.ConstructInstanceTypes(ctx)
	if err != nil {
		log.FromContext(ctx).Error(err, "failed constructing instance types")
	}
	if path := os.Getenv(templatesEnv); path != "" {
		attached, err := attachTemplates(instanceTypes, path)
		if err != nil {
			log.FromContext(ctx).Error(err, "cannot attach ResourceSliceTemplates", "file", path)
			os.Exit(1)
		}
		log.FromContext(ctx).Info("attached ResourceSliceTemplates", "file", path, "slices", attached)
	}

	overlayUndecoratedCloudProvider := kwok.NewCloudProvider(ctx, op.GetClient(), instanceTypes)
	cloudProvider := overlay.Decorate(overlayUndecoratedCloudProvider, op.GetClient(), op.InstanceTypeStore)
	repairPolicyMatcher := lo.Must(health.NewRepairPolicyMatcher(ctx, cloudProvider))
	clusterState := state.NewCluster(op.Clock, op.GetClient(), cloudProvider, state.WithRepairPolicyMatcher(repairPolicyMatcher))
	op.
		WithControllers(ctx, controllers.NewControllers(
			ctx,
			op.Manager,
			op.Clock,
			op.GetClient(),
			op.EventRecorder,
			cloudProvider,
			overlayUndecoratedCloudProvider,
			clusterState,
			op.InstanceTypeStore,
			op.PredictionStore,
		)...).Start(ctx)
}

// attachTemplates reads the file and gives each named instance type its slices as templates;
// it returns how many slices were attached. A type the file names that the provider does not
// have is an error: the test would otherwise run without the templates it meant to give.
func attachTemplates(instanceTypes []*cloudprovider.InstanceType, path string) (int, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return 0, err
	}
	var specs map[string][]resourcev1.ResourceSliceSpec
	if err := json.Unmarshal(data, &specs); err != nil {
		return 0, fmt.Errorf("not a JSON object of instance type -> ResourceSliceSpecs: %w", err)
	}
	byName := lo.KeyBy(instanceTypes, func(it *cloudprovider.InstanceType) string { return it.Name })
	attached := 0
	for name, slices := range specs {
		it, ok := byName[name]
		if !ok {
			return 0, fmt.Errorf("instance type %q is not one of the provider's", name)
		}
		for _, spec := range slices {
			it.DynamicResources.ResourceSliceTemplates = append(it.DynamicResources.ResourceSliceTemplates, template(spec))
			attached++
		}
	}
	return attached, nil
}

func template(spec resourcev1.ResourceSliceSpec) *cloudprovider.ResourceSliceTemplate {
	devices := make([]cloudprovider.Device, 0, len(spec.Devices))
	for _, d := range spec.Devices {
		devices = append(devices, cloudprovider.Device{
			Name:                     unique.Make(d.Name),
			Attributes:               d.Attributes,
			Capacity:                 d.Capacity,
			AllowMultipleAllocations: lo.FromPtr(d.AllowMultipleAllocations),
			ConsumesCounters:         d.ConsumesCounters,
		})
	}
	return &cloudprovider.ResourceSliceTemplate{
		Driver:         unique.Make(spec.Driver),
		Pool:           cloudprovider.ResourcePool{Name: unique.Make(spec.Pool.Name)},
		Devices:        devices,
		SharedCounters: spec.SharedCounters,
	}
}
