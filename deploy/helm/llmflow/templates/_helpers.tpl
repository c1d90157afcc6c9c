{{/* Names, labels and the pieces several templates share. */}}

{{- define "llmflow.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "llmflow.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "llmflow.selectorLabels" -}}
app.kubernetes.io/name: {{ include "llmflow.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "llmflow.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "llmflow.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "llmflow.secretName" -}}
{{- if .Values.secrets.create -}}
{{- include "llmflow.fullname" . -}}
{{- else -}}
{{- required "secrets.existingSecret: name the Secret that holds the keys (or set secrets.create: true)" .Values.secrets.existingSecret -}}
{{- end -}}
{{- end -}}

{{- define "llmflow.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "llmflow.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "llmflow.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{- define "llmflow.redisHost" -}}
{{- printf "%s-redis" (include "llmflow.fullname" .) | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The port /metrics is served on: the admin listener's, or the API's when it is off. */}}
{{- define "llmflow.metricsPortName" -}}
{{- if .Values.admin.enabled }}admin{{ else }}http{{ end -}}
{{- end -}}

{{- define "llmflow.metricsPort" -}}
{{- if .Values.admin.enabled }}{{ .Values.admin.port }}{{ else }}{{ .Values.service.port }}{{ end -}}
{{- end -}}

{{/*
The config file without its keys: the user's `config` with the keys the chart owns laid over
it. Keys in `config` that the chart owns, or that are secrets, stop the render with the value
to use instead.
*/}}
{{- define "llmflow.config" -}}
{{- $config := deepCopy .Values.config -}}
{{- range $tenant := ($config.tenants | default list) -}}
{{- if hasKey $tenant "api_keys" -}}
{{- fail (printf "config.tenants[%s].api_keys: keys do not go in the ConfigMap; put them in secrets.tenantApiKeys.%s (or the existing Secret's key tenant.%s)" $tenant.name $tenant.name $tenant.name) -}}
{{- end -}}
{{- end -}}
{{- if hasKey $config "admin" -}}
{{- fail "config.admin: the chart sets it; use admin.enabled/admin.port and secrets.adminApiKey" -}}
{{- end -}}
{{- if hasKey $config "state" -}}
{{- fail "config.state: the chart sets it; use redis.mode, redis.onLoss, redis.leaseTtl, redis.syncInterval" -}}
{{- end -}}
{{- $server := $config.server | default dict -}}
{{- range $key := list "host" "port" "drain_timeout_ms" -}}
{{- if hasKey $server $key -}}
{{- fail (printf "config.server.%s: the chart sets it; use service.port or drain.timeoutSeconds" $key) -}}
{{- end -}}
{{- end -}}
{{- $_ := set $server "host" "0.0.0.0" -}}
{{- $_ := set $server "port" (int .Values.service.port) -}}
{{- $_ := set $server "drain_timeout_ms" (mul (int .Values.drain.timeoutSeconds) 1000) -}}
{{- /* A gateway without API keys answers only the Host names it knows (DNS rebinding,
docs/reliability.md): the in-cluster names of its two Services, then what the user adds
(an Ingress host, say) in config.server.allowed_hosts. */ -}}
{{- $hosts := list -}}
{{- range $service := list (include "llmflow.fullname" $) (printf "%s-admin" (include "llmflow.fullname" $)) -}}
{{- $hosts = concat $hosts (list $service (printf "%s.%s" $service $.Release.Namespace) (printf "%s.%s.svc" $service $.Release.Namespace) (printf "%s.%s.svc.cluster.local" $service $.Release.Namespace)) -}}
{{- end -}}
{{- $_ := set $server "allowed_hosts" (concat $hosts ($server.allowed_hosts | default list) | uniq) -}}
{{- $_ := set $config "server" $server -}}
{{- if .Values.admin.enabled -}}
{{- $_ := set $config "admin" (dict "host" "0.0.0.0" "port" (int .Values.admin.port)) -}}
{{- end -}}
{{- $gate := $config.gate | default dict -}}
{{- if hasKey $gate "mode" -}}
{{- fail "config.gate.mode: the chart sets it; use gate.mode (enforce or shadow)" -}}
{{- end -}}
{{- $_ := set $gate "mode" .Values.gate.mode -}}
{{- $_ := set $config "gate" $gate -}}
{{- if hasKey $config "telemetry" -}}
{{- fail "config.telemetry: the chart sets it; use otel.endpoint, otel.serviceName, otel.sampleRatio" -}}
{{- end -}}
{{- if .Values.otel.endpoint -}}
{{- $_ := set $config "telemetry" (dict "otlp_endpoint" .Values.otel.endpoint "service_name" .Values.otel.serviceName "sample_ratio" .Values.otel.sampleRatio) -}}
{{- end -}}
{{- if ne .Values.redis.mode "none" -}}
{{- $_ := set $config "state" (dict "backend" "redis" "replicas" (int .Values.replicaCount) "on_loss" .Values.redis.onLoss "lease_ttl_ms" .Values.redis.leaseTtl "sync_interval_ms" .Values.redis.syncInterval) -}}
{{- end -}}
{{- toYaml $config -}}
{{- end -}}

{{/* Checks across values that a single template cannot make alone. */}}
{{- define "llmflow.validate" -}}
{{- if not (has .Values.redis.mode (list "none" "bundled" "external")) -}}
{{- fail (printf "redis.mode: %q is not one of none, bundled, external" .Values.redis.mode) -}}
{{- end -}}
{{- if and (gt (int .Values.replicaCount) 1) (eq .Values.redis.mode "none") -}}
{{- fail (printf "replicaCount: %d replicas need shared state; set redis.mode to bundled or external (docs/scale.md), or replicaCount: 1" (int .Values.replicaCount)) -}}
{{- end -}}
{{- if not (has .Values.gate.mode (list "enforce" "shadow")) -}}
{{- fail (printf "gate.mode: %q is not one of enforce, shadow" .Values.gate.mode) -}}
{{- end -}}
{{- if and (eq .Values.gate.mode "shadow") (ne .Values.redis.mode "none") -}}
{{- fail "gate.mode: shadow runs on one gateway alone (no Redis replicas); set replicaCount: 1 and redis.mode: none, or gate.mode: enforce" -}}
{{- end -}}
{{- if and .Values.secrets.create (eq .Values.redis.mode "external") (not .Values.secrets.redisUrl) -}}
{{- fail "secrets.redisUrl: redis.mode external needs the URL, such as redis://:password@redis:6379/0" -}}
{{- end -}}
{{- if and .Values.secrets.adminApiKey (lt (len .Values.secrets.adminApiKey) 16) -}}
{{- fail "secrets.adminApiKey: at least 16 characters (or leave it empty to have one generated)" -}}
{{- end -}}
{{- end -}}
