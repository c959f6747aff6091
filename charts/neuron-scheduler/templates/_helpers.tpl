{{/*
Names default to the upstream chart's, so its Service URL, pod opt-in and docs keep working. The
upstream `fullnameOverride` and `nameOverride` keep their meaning: a non-empty fullnameOverride is
the name; an empty one gives <release>-<nameOverride or the default> (the release name alone when
it already contains that); unset, the default. Called with (list <values block> <default> $).
*/}}
{{- define "ns.fullname" -}}
{{- $block := index . 0 -}}
{{- $default := index . 1 -}}
{{- $root := index . 2 -}}
{{- if kindIs "invalid" $block.fullnameOverride -}}
{{- $default -}}
{{- else if $block.fullnameOverride -}}
{{- $block.fullnameOverride | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- $name := $block.nameOverride | default $default -}}
{{- if contains $name $root.Release.Name -}}
{{- $root.Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" $root.Release.Name $name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}
{{- define "ns.extender" -}}{{ include "ns.fullname" (list .Values.scheduler "k8s-neuron-scheduler" .) }}{{- end -}}
{{- define "ns.devicePlugin" -}}{{ include "ns.fullname" (list .Values.devicePlugin "neuron-device-plugin" .) }}{{- end -}}
{{/* customScheduler.fullnameOverride (upstream), when set, wins over customScheduler.name (ours). */}}
{{- define "ns.scheduler" -}}{{ include "ns.fullname" (list .Values.scheduler.customScheduler .Values.scheduler.customScheduler.name .) }}{{- end -}}

{{/* Each component's namespace: the upstream namespaceOverride, else the release namespace. */}}
{{- define "ns.extenderNamespace" -}}{{ .Values.scheduler.namespaceOverride | default .Release.Namespace }}{{- end -}}
{{- define "ns.schedulerNamespace" -}}{{ .Values.scheduler.customScheduler.namespaceOverride | default .Release.Namespace }}{{- end -}}
{{- define "ns.devicePluginNamespace" -}}{{ .Values.devicePlugin.namespaceOverride | default .Release.Namespace }}{{- end -}}

{{/*
The ServiceAccount a component runs as: serviceAccount.name, else the component's name. With
serviceAccount.create=false the chart binds its roles to that existing account (validated: a name
is required, never the namespace's `default`). Called with (list <values block> <name>).
*/}}
{{- define "ns.serviceAccountName" -}}
{{- $account := (index . 0).serviceAccount | default dict -}}
{{- $account.name | default (index . 1) -}}
{{- end -}}
{{- define "ns.createServiceAccount" -}}
{{- $account := (index . 0).serviceAccount | default dict -}}
{{- if or (kindIs "invalid" $account.create) $account.create -}}true{{- end -}}
{{- end -}}

{{/*
Pod selector labels: the upstream selectorLabelsOverride when given, else name and instance.
Called with (list <values block> <name> $).
*/}}
{{- define "ns.selector" -}}
{{- $override := (index . 0).selectorLabelsOverride -}}
{{- if $override -}}
{{ toYaml $override }}
{{- else -}}
app.kubernetes.io/name: {{ index . 1 }}
app.kubernetes.io/instance: {{ (index . 2).Release.Name }}
{{- end -}}
{{- end -}}

{{/* A pod template's labels: the chart's, name and component, and the selector override. Called
with (list <values block> <name> <component> $). */}}
{{- define "ns.podLabels" -}}
{{- $root := index . 3 -}}
{{- $labels := include "ns.labels" $root | fromYaml -}}
{{- $_ := set $labels "app.kubernetes.io/name" (index . 1) -}}
{{- $_ := set $labels "app.kubernetes.io/component" (index . 2) -}}
{{- range $key, $value := (index . 0).selectorLabelsOverride | default dict -}}
{{- $_ := set $labels $key $value -}}
{{- end -}}
{{ toYaml $labels }}
{{- end -}}

{{/*
`base` with each key of `overrides` replacing its own (one level: a given `capabilities` replaces
the chart's whole). Used for the upstream securityContext and podSecurityContext keys, given over
the chart's hardened defaults. Called with (list <base dict> <overrides or nil>).
*/}}
{{- define "ns.overlay" -}}
{{- $result := deepCopy (index . 0) -}}
{{- range $key, $value := index . 1 | default dict -}}
{{- $_ := set $result $key $value -}}
{{- end -}}
{{- if $result }}{{ toYaml $result }}{{ end -}}
{{- end -}}

{{/* A list of named items (env, volumes) with the user's items after the chart's, replacing the
chart's items of the same `key`. Called with (list <chart's list> <user's list or nil> <key>). */}}
{{- define "ns.mergeNamed" -}}
{{- $key := index . 2 -}}
{{- $given := index . 1 | default list -}}
{{- $taken := dict -}}
{{- range $given -}}{{- $_ := set $taken (toString (index . $key)) true -}}{{- end -}}
{{- $result := list -}}
{{- range index . 0 -}}
{{- if not (hasKey $taken (toString (index . $key))) -}}{{- $result = append $result . -}}{{- end -}}
{{- end -}}
{{- $result = concat $result $given -}}
{{- if $result }}{{ toYaml $result }}{{ end -}}
{{- end -}}

{{/* Image pull secrets: the chart-wide ones, then the component's (upstream
<component>.imagePullSecrets). Called with (list <values block> $). */}}
{{- define "ns.pullSecrets" -}}
{{- $all := concat ((index . 1).Values.imagePullSecrets | default list) ((index . 0).imagePullSecrets | default list) | uniq -}}
{{- if $all }}{{ toYaml $all }}{{ end -}}
{{- end -}}

{{- define "ns.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
app.kubernetes.io/part-of: neuron-scheduler
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end -}}

{{- define "ns.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
AWS's own images: they cannot run this chart's commands, so a `scheduler.image` or
`devicePlugin.image` naming one (an upstream values file does) is set aside for `image.*`, and the
install notes say so.
*/}}
{{- define "ns.awsImages" -}}
{"scheduler": "public.ecr.aws/neuron/neuron-scheduler", "devicePlugin": "public.ecr.aws/neuron/neuron-device-plugin"}
{{- end -}}
{{/* The component's own image block, or an empty one when it names AWS's image. Called with
(list <component: scheduler|devicePlugin> $); returns JSON. */}}
{{- define "ns.ownImage" -}}
{{- $root := index . 1 -}}
{{- $own := (index $root.Values (index . 0)).image | default dict -}}
{{- $aws := index (include "ns.awsImages" $root | fromJson) (index . 0) -}}
{{- if eq (toString $own.repository) $aws -}}{}{{- else -}}{{ toJson $own }}{{- end -}}
{{- end -}}
{{/* The extender's or device plugin's image: its own image.* keys (upstream), each falling back
to the chart-wide image.* and the tag to the chart's appVersion. */}}
{{- define "ns.componentImage" -}}
{{- $root := index . 1 -}}
{{- $own := include "ns.ownImage" . | fromJson -}}
{{ $own.repository | default $root.Values.image.repository }}:{{ $own.tag | default $root.Values.image.tag | default $root.Chart.AppVersion }}
{{- end -}}
{{- define "ns.componentPullPolicy" -}}
{{- $own := include "ns.ownImage" . | fromJson -}}
{{ $own.pullPolicy | default (index . 1).Values.image.pullPolicy }}
{{- end -}}

{{/* registry.k8s.io tags are vX.Y.Z; managed clusters report e.g. v1.30.4-eks-a737599. */}}
{{- define "ns.schedulerImage" -}}
{{- $img := .Values.scheduler.customScheduler.image -}}
{{- $tag := $img.tag | default (regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version) -}}
{{ $img.repository }}:{{ $tag }}
{{- end -}}

{{/* Extender replicas: the upstream scheduler.replicaCount when given, else scheduler.replicas. */}}
{{- define "ns.extenderReplicas" -}}
{{- $s := .Values.scheduler -}}
{{- if kindIs "invalid" $s.replicaCount }}{{ int $s.replicas }}{{ else }}{{ int $s.replicaCount }}{{ end -}}
{{- end -}}
{{/* my-scheduler replicas: customScheduler.replicaCount (upstream) when given, else .replicas. */}}
{{- define "ns.schedulerReplicas" -}}
{{- $c := .Values.scheduler.customScheduler -}}
{{- if kindIs "invalid" $c.replicaCount }}{{ int $c.replicas }}{{ else }}{{ int $c.replicaCount }}{{ end -}}
{{- end -}}

{{- define "ns.leaderElect" -}}
{{- if or (gt (int (include "ns.extenderReplicas" .)) 1) .Values.scheduler.leaderElection.enabled -}}true{{- end -}}
{{- end -}}

{{- define "ns.scheme" -}}{{ if .Values.scheduler.tls.enabled }}https{{ else }}http{{ end }}{{- end -}}

{{/* The Secrets holding the extender's serving certificate and kube-scheduler's client one. */}}
{{- define "ns.serverSecret" -}}
{{- .Values.scheduler.tls.existingSecret | default (printf "%s-tls" (include "ns.extender" .)) -}}
{{- end -}}
{{- define "ns.clientSecret" -}}
{{- .Values.scheduler.tls.existingClientSecret | default (printf "%s-client-tls" (include "ns.extender" .)) -}}
{{- end -}}
{{/* The client certificate lives where its reader runs: my-scheduler's namespace in custom mode;
in default-scheduler mode, next to the extender (an operator copies it onto the hosts). */}}
{{- define "ns.clientSecretNamespace" -}}
{{- if .Values.scheduler.customScheduler.enabled -}}{{ include "ns.schedulerNamespace" . }}{{- else -}}{{ include "ns.extenderNamespace" . }}{{- end -}}
{{- end -}}

{{/* The names the serving certificate must carry: the Service, however it is reached. */}}
{{- define "ns.serviceNames" -}}
{{- $svc := include "ns.extender" . -}}
{{- $ns := include "ns.extenderNamespace" . -}}
{{- list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.%s" $svc $ns .Values.scheduler.clusterDomain) | toJson -}}
{{- end -}}

{{/* cert-manager's privateKey for both certificates: the type scheduler.tls.keyAlgorithm names.
A new key at every issuance (rotationPolicy Always, cert-manager's default since 1.18): with Never,
the default before, a Certificate whose key type changes (on upgrade from a chart that asked for
none, so RSA) stops being issued until someone deletes its Secret. */}}
{{- define "ns.certManagerKey" -}}
{{- if eq .Values.scheduler.tls.keyAlgorithm "rsa" -}}
algorithm: RSA
size: 2048
{{- else -}}
algorithm: ECDSA
size: 256
{{- end }}
rotationPolicy: Always
{{- end -}}

{{/* The kube-scheduler profile whose binds the extender serves. */}}
{{- define "ns.profile" -}}
{{- if .Values.scheduler.defaultScheduler.enabled -}}
{{ .Values.scheduler.defaultScheduler.schedulerName }}
{{- else -}}
{{ include "ns.scheduler" . }}
{{- end -}}
{{- end -}}

{{/* The URL kube-scheduler calls: the Service's DNS name for my-scheduler, a node port otherwise. */}}
{{- define "ns.urlPrefix" -}}
{{- if .Values.scheduler.defaultScheduler.enabled -}}
{{ .Values.scheduler.defaultScheduler.urlPrefix | default (printf "%s://127.0.0.1:%d" (include "ns.scheme" .) (int .Values.scheduler.defaultScheduler.nodePort)) }}
{{- else -}}
{{ include "ns.scheme" . }}://{{ include "ns.extender" . }}.{{ include "ns.extenderNamespace" . }}.svc.{{ .Values.scheduler.clusterDomain }}:12345
{{- end -}}
{{- end -}}

{{/*
The extender entry of a KubeSchedulerConfiguration; the same entry the end-to-end testbed gives
its kube-scheduler (tests/testbed/manifests.py).
*/}}
{{- define "ns.extenderEntry" -}}
- urlPrefix: {{ include "ns.urlPrefix" . | quote }}
  filterVerb: filter
  prioritizeVerb: prioritize
  {{- if .Values.scheduler.preemption }}
  # Victims that free a contiguous block (docs/preemption.md).
  preemptVerb: preempt
  {{- end }}
  # At 20 one point of topology score outweighs any in-tree score (values.yaml scheduler.scoring).
  weight: {{ .Values.scheduler.scoring.extenderWeight }}
  bindVerb: bind
  nodeCacheCapable: {{ .Values.scheduler.nodeCacheCapable }}
  # A down extender must fail scheduling, not silently bypass it.
  ignorable: false
  # ignoredByScheduler false: kube-scheduler's own fit check still counts these resources, so the
  # extender only sees nodes with enough capacity.
  managedResources:
    - name: aws.amazon.com/neuron
      ignoredByScheduler: false
    - name: aws.amazon.com/neuroncore
      ignoredByScheduler: false
    - name: aws.amazon.com/neurondevice
      ignoredByScheduler: false
  {{- include "ns.extenderTLS" . }}
{{- end -}}

{{/*
With the DRA driver on, extender entries that score nodes for pods with claims of the chart's DRA
classes (docs/dra.md "Node choice"): prioritize-claims, the best-fit measure, at the extender's
weight; and with scoring.packNeuron, prioritize-claims-packing at weight 1, how full each node is
(the MostAllocated tie-break NodeResourcesFit gives Neuron resources, which cannot count DRA
claims). Prioritize only: such pods request no resource the first entry manages, so these have no
managedResources and kube-scheduler asks them about every pod (they answer 0 for all but ours);
they never filter, bind or fail a pod, and a down extender costs only the scores
(kube-scheduler ignores prioritize errors).
*/}}
{{- define "ns.draExtenderEntry" -}}
{{- if .Values.dra.enabled -}}
{{- include "ns.claimsEntry" (list . "prioritize-claims" .Values.scheduler.scoring.extenderWeight) }}
{{- if .Values.scheduler.scoring.packNeuron }}
{{ include "ns.claimsEntry" (list . "prioritize-claims-packing" 1) }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "ns.claimsEntry" -}}
{{- $ := index . 0 -}}
- urlPrefix: {{ include "ns.urlPrefix" $ | quote }}
  prioritizeVerb: {{ index . 1 }}
  weight: {{ index . 2 }}
  nodeCacheCapable: {{ $.Values.scheduler.nodeCacheCapable }}
  ignorable: true
  {{- include "ns.extenderTLS" $ }}
{{- end -}}

{{- define "ns.extenderTLS" -}}
  {{- if .Values.scheduler.tls.enabled }}
  enableHTTPS: true
  # kube-scheduler checks the extender's certificate and presents its own client certificate:
  # without it the extender's TLS handshake fails.
  tlsConfig:
    serverName: {{ include "ns.extender" . }}.{{ include "ns.extenderNamespace" . }}.svc
    {{- if .Values.scheduler.customScheduler.enabled }}
    certFile: /etc/neuron-scheduler/client/tls.crt
    keyFile: /etc/neuron-scheduler/client/tls.key
    caFile: /etc/neuron-scheduler/client/ca.crt
    {{- else }}
    # On each control plane host, from Secret {{ include "ns.clientSecret" . }}: tls.crt, tls.key and
    # ca.crt (the install notes show the commands).
    certFile: /etc/kubernetes/neuron-scheduler/client.crt
    keyFile: /etc/kubernetes/neuron-scheduler/client.key
    caFile: /etc/kubernetes/neuron-scheduler/ca.crt
    {{- end }}
  {{- end }}
{{- end -}}

{{/*
my-scheduler's profile; the same the testbed's kube-scheduler runs (sim/kubescheduler.py CHART,
rendered by scheduler_profile; tests/e2e/test_chart.py compares them).
*/}}
{{- define "ns.schedulerProfile" -}}
- schedulerName: {{ include "ns.scheduler" . }}
  {{- if .Values.scheduler.scoring.packNeuron }}
  plugins:
    score:
      disabled:
        - name: NodeResourcesBalancedAllocation
  pluginConfig:
    - name: NodeResourcesFit
      args:
        scoringStrategy:
          type: MostAllocated
          resources:
            - name: aws.amazon.com/neuron
              weight: 1
            - name: aws.amazon.com/neuroncore
              weight: 1
  {{- end }}
{{- end -}}

{{- define "ns.validate" -}}
{{- $s := .Values.scheduler -}}
{{- if $s.enabled -}}
{{- if and $s.tls.enabled $s.tls.existingSecret (not $s.tls.existingClientSecret) -}}
{{- fail "scheduler.tls.existingSecret is set but scheduler.tls.existingClientSecret is not: kube-scheduler needs the client certificate the extender accepts (tls.crt, tls.key, ca.crt)" -}}
{{- end -}}
{{- if and $s.tls.enabled $s.tls.certManager.enabled (not $s.tls.certManager.issuerRef.name) -}}
{{- fail "scheduler.tls.certManager.enabled needs scheduler.tls.certManager.issuerRef.name: the cert-manager issuer that signs both certificates" -}}
{{- end -}}
{{- if and $s.customScheduler.enabled $s.defaultScheduler.enabled -}}
{{- fail "scheduler.customScheduler.enabled and scheduler.defaultScheduler.enabled are both true: choose one scheduler mode (custom: a my-scheduler Deployment, required on EKS; default: extend the control plane's own kube-scheduler), e.g. --set scheduler.customScheduler.enabled=false" -}}
{{- end -}}
{{- if not (or $s.customScheduler.enabled $s.defaultScheduler.enabled) -}}
{{- fail "scheduler.enabled is true but neither scheduler.customScheduler.enabled nor scheduler.defaultScheduler.enabled is: turn exactly one on, or set scheduler.enabled=false" -}}
{{- end -}}
{{- else if not (or .Values.devicePlugin.enabled .Values.dra.enabled) -}}
{{- fail "scheduler.enabled, devicePlugin.enabled and dra.enabled are all false: the chart would install nothing" -}}
{{- end -}}
{{- with $s.strategy -}}
{{- if and .type (ne .type "Recreate") -}}
{{- fail (printf "scheduler.strategy.type is %s: the extender only upgrades with Recreate (a rolling update runs two binding extenders side by side, and with leader election waits forever for a standby to become ready); leave scheduler.strategy out or set type: Recreate" .type) -}}
{{- end -}}
{{- end -}}
{{- range $key, $block := dict "scheduler" $s "scheduler.customScheduler" $s.customScheduler "devicePlugin" .Values.devicePlugin -}}
{{- $account := $block.serviceAccount | default dict -}}
{{- if and (not (kindIs "invalid" $account.create)) (not $account.create) (not $account.name) -}}
{{- fail (printf "%s.serviceAccount.create is false but %s.serviceAccount.name is empty: name the existing ServiceAccount to bind the chart's roles to (never the namespace's default account)" $key $key) -}}
{{- end -}}
{{- end -}}
{{- include "ns.validateKubeVersion" . -}}
{{- end -}}

{{/* What needs a newer Kubernetes than the chart's kubeVersion floor, refused by name on clusters
that lack it, rather than installed to fail at run time (docs/install.md, "Tested on"). */}}
{{- define "ns.validateKubeVersion" -}}
{{- $version := .Capabilities.KubeVersion.Version -}}
{{- if .Values.dra.enabled -}}
{{- if semverCompare "<1.35.0-0" $version -}}
{{- fail (printf "dra.enabled needs Kubernetes 1.35 or newer, and this cluster is %s: the DRA driver's devices (device sets, dra.coreWindows) share counters in resource.k8s.io/v1 ResourceSlices, the layout partitionable devices have from 1.35, and a failed device is kept from claims by device taints (1.35: turn on the DRAPartitionableDevices and DRADeviceTaints feature gates; 1.36 and later: on by default). Older versions serve the device plugin path only: leave dra.enabled false (docs/dra.md)" $version) -}}
{{- end -}}
{{- if not (.Capabilities.APIVersions.Has "resource.k8s.io/v1") -}}
{{- fail (printf "dra.enabled needs the resource.k8s.io/v1 API, which this cluster (%s) does not serve: turn DynamicResourceAllocation back on, or leave dra.enabled false (docs/dra.md)" $version) -}}
{{- end -}}
{{- end -}}
{{- end -}}
