{{/* Release-scoped name, at most 40 characters (KubeRay appends suffixes to RayCluster names). */}}
{{- define "pagedserve.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ .Chart.Name }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "pagedserve.labels" -}}
{{ include "pagedserve.selectorLabels" . }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "pagedserve.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{/*
The Ray Serve config file (the format `serve run` / `serve deploy` read) embedded in the RayService.
Each replica gets a placement group: the replica actor's bundle first, then one GPU bundle per
tensor-parallel rank, packed onto one node.
*/}}
{{- define "pagedserve.serveConfig" -}}
{{- $tp := int .Values.engine.parallel.tensor_parallel_size -}}
{{- if lt $tp 1 -}}
{{- fail "engine.parallel.tensor_parallel_size must be at least 1" -}}
{{- end -}}
{{- if gt $tp (int .Values.gpuWorkers.gpusPerPod) -}}
{{- fail "engine.parallel.tensor_parallel_size cannot exceed gpuWorkers.gpusPerPod (a replica's ranks share one node)" -}}
{{- end -}}
{{- $auto := .Values.serve.autoscaling -}}
{{- if gt (int $auto.minReplicas) (int $auto.maxReplicas) -}}
{{- fail "serve.autoscaling.minReplicas cannot exceed serve.autoscaling.maxReplicas" -}}
{{- end -}}
{{- $bundles := list (dict "CPU" .Values.serve.replicaCpus) -}}
{{- range until $tp -}}
{{- $bundles = append $bundles (dict "CPU" $.Values.serve.workerCpus "GPU" 1) -}}
{{- end -}}
{{- $grace := .Values.serve.shutdownGraceS -}}
{{- if ge (float64 $grace) (float64 (sub (int .Values.terminationGracePeriodSeconds) 5)) -}}
{{- fail "terminationGracePeriodSeconds must exceed serve.shutdownGraceS by more than 5 s (Kubernetes kills the pod when it ends)" -}}
{{- end -}}
{{- $args := dict "engine" .Values.engine "served_model_name" .Values.servedModelName "shutdown" (dict "grace_s" $grace) "stream_interval" (int .Values.serve.streamInterval) -}}
{{- $_ := set $args "enable_auto_tool_choice" .Values.tools.enableAutoToolChoice -}}
{{- if .Values.tools.toolCallParser -}}
{{- $_ := set $args "tool_call_parser" .Values.tools.toolCallParser -}}
{{- end -}}
{{- if .Values.lora.modules -}}
{{- $_ := set $args "lora_modules" .Values.lora.modules -}}
{{- end -}}
{{- if .Values.lora.allowRuntimeUpdating -}}
{{- $_ := set $args "allow_runtime_lora_updating" true -}}
{{- end -}}
{{- $deployment := dict
      "name" "GenerationServer"
      "max_ongoing_requests" (int .Values.serve.maxOngoingRequests)
      "max_queued_requests" (int .Values.serve.maxQueuedRequests)
      "autoscaling_config" (dict
        "min_replicas" (int $auto.minReplicas)
        "max_replicas" (int $auto.maxReplicas)
        "target_ongoing_requests" $auto.targetOngoingRequests
        "upscale_delay_s" $auto.upscaleDelayS
        "downscale_delay_s" $auto.downscaleDelayS
        "policy" (dict
          "policy_function" "cluster.serving.autoscaling:KVPressurePolicy"
          "policy_kwargs" (dict "target_kv_utilization" $auto.targetKvUtilization)))
      "ray_actor_options" (dict "num_cpus" .Values.serve.replicaCpus)
      "graceful_shutdown_timeout_s" $grace
      "health_check_period_s" .Values.serve.healthCheckPeriodS
      "placement_group_strategy" "STRICT_PACK"
      "placement_group_bundles" $bundles -}}
{{- if .Values.serve.routing.prefixAware -}}
{{- $_ := set $deployment "request_router_config" (dict
      "request_router_class" "cluster.serving.routing:PrefixAwareRouter"
      "request_routing_stats_period_s" .Values.serve.routing.statsPeriodS) -}}
{{- end -}}
{{- $ingressScaling := .Values.serve.ingress -}}
{{- $ingress := dict
      "name" "OpenAIIngress"
      "max_ongoing_requests" (int $ingressScaling.maxOngoingRequests)
      "autoscaling_config" (dict
        "min_replicas" (int $ingressScaling.minReplicas)
        "max_replicas" (int $ingressScaling.maxReplicas)
        "target_ongoing_requests" $ingressScaling.targetOngoingRequests)
      "graceful_shutdown_timeout_s" (addf $grace 5)
      "ray_actor_options" (dict "num_cpus" $ingressScaling.cpus) -}}
{{- $app := dict
      "name" .Values.serve.appName
      "route_prefix" .Values.serve.routePrefix
      "import_path" .Values.serve.importPath
      "args" $args
      "deployments" (list $ingress $deployment) -}}
{{- $config := dict
      "proxy_location" "EveryNode"
      "http_options" (dict "host" "0.0.0.0" "port" (int .Values.serve.httpPort))
      "grpc_options" (dict
        "port" (int .Values.serve.grpcPort)
        "grpc_servicer_functions" (list
          "cluster.serving.grpc_wire.add_GenerationServicer_to_server"
          "cluster.serving.grpc_wire.add_HealthServicer_to_server"))
      "applications" (list $app) -}}
{{- toYaml $config -}}
{{- end -}}
