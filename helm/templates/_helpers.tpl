{{- define "appliance.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "appliance.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "appliance.selectorLabels" -}}
app.kubernetes.io/name: {{ include "appliance.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "appliance.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{ include "appliance.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{/* The spec as the pod reads it: the values' spec, served on 0.0.0.0:8000, with the API key's variable. */}}
{{- define "appliance.spec" -}}
{{- $spec := deepCopy (default dict .Values.spec) -}}
{{- $server := default dict (get $spec "server") -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ := set $server "port" 8000 -}}
{{- if .Values.apiKeySecret -}}
{{- $_ := set $server "api_key" (dict "env" "APPLIANCE_API_KEY") -}}
{{- end -}}
{{- $_ := set $spec "server" $server -}}
{{- toYaml $spec -}}
{{- end -}}

{{/* Ranks in one pod: tp x dp of the spec. */}}
{{- define "appliance.ranks" -}}
{{- $parallel := default dict (get (default dict .Values.spec) "parallel") -}}
{{- mul (int (default 1 (get $parallel "tp"))) (int (default 1 (get $parallel "dp"))) -}}
{{- end -}}

{{/* A CPU quantity in whole CPUs: 4, "4", "4.0" or "4000m" (the schema has refused any other form). */}}
{{- define "appliance.cpus" -}}
{{- $cpus := toString . -}}
{{- if hasSuffix "m" $cpus -}}{{- div (atoi (trimSuffix "m" $cpus)) 1000 -}}{{- else -}}{{- regexReplaceAll "\\.0+$" $cpus "" -}}{{- end -}}
{{- end -}}

{{/* A memory quantity in bytes, as Kubernetes reads it: 8Gi = 8192Mi = 8589934592. */}}
{{- define "appliance.bytes" -}}
{{- if or (kindIs "float64" .) (kindIs "int" .) (kindIs "int64" .) -}}
{{- printf "%.0f" (float64 .) -}}
{{- else -}}
{{- $text := toString . -}}
{{- $units := dict "Ki" 1024 "Mi" 1048576 "Gi" 1073741824 "Ti" 1099511627776 "Pi" 1125899906842624 "Ei" 1152921504606846976 "k" 1000 "M" 1000000 "G" 1000000000 "T" 1000000000000 "P" 1000000000000000 "E" 1000000000000000000 -}}
{{- $number := regexFind "^[0-9.]+" $text -}}
{{- $scale := get $units (trimPrefix $number $text) | default 1 -}}
{{- printf "%.0f" (mulf (float64 $number) $scale) -}}
{{- end -}}
{{- end -}}

{{/* Guaranteed QoS with exclusive cores: requests equal limits, whole CPUs. Fails the render otherwise. */}}
{{- define "appliance.checkResources" -}}
{{- $r := .Values.resources -}}
{{- $cpus := int (include "appliance.cpus" $r.limits.cpu) -}}
{{- if ne (include "appliance.cpus" $r.requests.cpu) (toString $cpus) -}}
{{- fail (printf "resources: requests.cpu (%v) must equal limits.cpu (%v): the static CPU manager grants exclusive cores only to Guaranteed pods" $r.requests.cpu $r.limits.cpu) -}}
{{- end -}}
{{- if ne (include "appliance.bytes" $r.requests.memory) (include "appliance.bytes" $r.limits.memory) -}}
{{- fail (printf "resources: requests.memory (%v) must equal limits.memory (%v): Guaranteed QoS needs both equal" $r.requests.memory $r.limits.memory) -}}
{{- end -}}
{{- $ranks := int (include "appliance.ranks" .) -}}
{{- if lt $cpus $ranks -}}
{{- fail (printf "resources.limits.cpu (%v) is fewer than the spec's tp x dp = %d ranks: each rank needs at least one CPU" $r.limits.cpu $ranks) -}}
{{- end -}}
{{- end -}}
