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

{{/* Guaranteed QoS with exclusive cores: requests equal limits, whole CPUs. Fails the render otherwise. */}}
{{- define "appliance.checkResources" -}}
{{- $r := .Values.resources -}}
{{- if ne (toString $r.requests.cpu) (toString $r.limits.cpu) -}}
{{- fail (printf "resources: requests.cpu (%v) must equal limits.cpu (%v): the static CPU manager grants exclusive cores only to Guaranteed pods" $r.requests.cpu $r.limits.cpu) -}}
{{- end -}}
{{- if ne (toString $r.requests.memory) (toString $r.limits.memory) -}}
{{- fail (printf "resources: requests.memory (%v) must equal limits.memory (%v), written the same way: Guaranteed QoS needs both equal" $r.requests.memory $r.limits.memory) -}}
{{- end -}}
{{- $ranks := int (include "appliance.ranks" .) -}}
{{- if lt (int $r.limits.cpu) $ranks -}}
{{- fail (printf "resources.limits.cpu (%v) is fewer than the spec's tp x dp = %d ranks: each rank needs at least one CPU" $r.limits.cpu $ranks) -}}
{{- end -}}
{{- end -}}
