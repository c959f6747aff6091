{{/* Names are fixed, as in the upstream chart, so its Service URL, pod opt-in and docs keep working. */}}
{{- define "ns.extender" -}}k8s-neuron-scheduler{{- end -}}
{{- define "ns.devicePlugin" -}}neuron-device-plugin{{- end -}}
{{- define "ns.scheduler" -}}{{ .Values.scheduler.customScheduler.name }}{{- end -}}

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

{{/* registry.k8s.io tags are vX.Y.Z; managed clusters report e.g. v1.30.4-eks-a737599. */}}
{{- define "ns.schedulerImage" -}}
{{- $img := .Values.scheduler.customScheduler.image -}}
{{- $tag := $img.tag | default (regexFind "^v[0-9]+\\.[0-9]+\\.[0-9]+" .Capabilities.KubeVersion.Version) -}}
{{ $img.repository }}:{{ $tag }}
{{- end -}}

{{- define "ns.leaderElect" -}}
{{- if or (gt (int .Values.scheduler.replicas) 1) .Values.scheduler.leaderElection.enabled -}}true{{- end -}}
{{- end -}}

{{- define "ns.scheme" -}}{{ if .Values.scheduler.tls.enabled }}https{{ else }}http{{ end }}{{- end -}}

{{/* The Secrets holding the extender's serving certificate and kube-scheduler's client one. */}}
{{- define "ns.serverSecret" -}}
{{- .Values.scheduler.tls.existingSecret | default (printf "%s-tls" (include "ns.extender" .)) -}}
{{- end -}}
{{- define "ns.clientSecret" -}}
{{- .Values.scheduler.tls.existingClientSecret | default (printf "%s-client-tls" (include "ns.extender" .)) -}}
{{- end -}}

{{/* The names the serving certificate must carry: the Service, however it is reached. */}}
{{- define "ns.serviceNames" -}}
{{- $svc := include "ns.extender" . -}}
{{- list $svc (printf "%s.%s" $svc .Release.Namespace) (printf "%s.%s.svc" $svc .Release.Namespace) (printf "%s.%s.svc.%s" $svc .Release.Namespace .Values.scheduler.clusterDomain) | toJson -}}
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
{{ include "ns.scheme" . }}://{{ include "ns.extender" . }}.{{ .Release.Namespace }}.svc.{{ .Values.scheduler.clusterDomain }}:12345
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
  weight: 1
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
  {{- if .Values.scheduler.tls.enabled }}
  enableHTTPS: true
  # kube-scheduler checks the extender's certificate and presents its own client certificate:
  # without it the extender's TLS handshake fails.
  tlsConfig:
    serverName: {{ include "ns.extender" . }}.{{ .Release.Namespace }}.svc
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
{{- end -}}
