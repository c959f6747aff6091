{{/* The DRA driver's object names and its DeviceClass names (dra-*.yaml). */}}
{{- define "ns.dra.name" -}}neuron-dra-driver{{- end -}}

{{/* <prefix>-1 .. <prefix>-<maxClassSize> and <coreClassPrefix>-<count> for each count of coreWindows,
as a YAML flow list of quoted names. */}}
{{- define "ns.dra.classNames" -}}
{{- $d := .Values.dra -}}
[{{- range $i, $size := untilStep 1 (int (add1 $d.maxClassSize)) 1 }}{{ if $i }}, {{ end }}"{{ $d.deviceClassPrefix }}-{{ $size }}"{{ end -}}
{{- range $count := $d.coreWindows }}, "{{ $d.coreClassPrefix }}-{{ $count }}"{{ end -}}]
{{- end -}}
