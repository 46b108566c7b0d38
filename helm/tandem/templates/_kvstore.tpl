{{/*
The KV store pod, shared by the StatefulSet and the DaemonSet form (kvstore.kind).
Called with (dict "root" $ "role" "kvstore").
*/}}

{{/* Resources: the pool is preallocated host memory, so memory is capacity + overhead
(request = limit: a store pod must never be the one the kernel's OOM killer picks
for overcommit) unless the user set a memory limit. */}}
{{- define "tandem.kvstore.resources" -}}
{{- $v := .Values.kvstore }}
{{- $res := deepCopy (default dict $v.resources) }}
{{- $limits := default dict $res.limits }}
{{- if not (hasKey $limits "memory") }}
{{- $mem := add (int64 $v.capacity) (int64 $v.memoryOverheadBytes) }}
{{- $_ := set $res "limits" (merge (dict "memory" $mem) (deepCopy $limits)) }}
{{- $_ := set $res "requests" (merge (dict "memory" $mem) (default dict $res.requests)) }}
{{- end }}
{{- toYaml $res }}
{{- end }}

{{- define "tandem.kvstore.podTemplate" -}}
{{- $root := .root }}
{{- $v := $root.Values.kvstore }}
metadata:
  labels:
    {{- include "tandem.selectorLabels" . | nindent 4 }}
    {{- with $v.podLabels }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  annotations:
    {{- include "tandem.configChecksum" $root | nindent 4 }}
    {{- with $v.podAnnotations }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
spec:
  serviceAccountName: {{ include "tandem.serviceAccountName" $root }}
  automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
  {{- with $root.Values.imagePullSecrets }}
  imagePullSecrets:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- include "tandem.podSecurityContext" $root | nindent 4 }}
  {{- with (include "tandem.scheduling" $v | trim) }}{{ . | nindent 2 }}{{ end }}
  containers:
    - name: kvstore
      image: {{ include "tandem.image" $root }}
      imagePullPolicy: {{ $root.Values.image.pullPolicy }}
      command: ["tandem", "kvstore"]
      args:
        # NOTE: listen on the pod IP, not 0.0.0.0: the store registers its listen address
        # in Redis, and readers on other nodes connect to that address.
        - --listen=$(TANDEM_POD_IP):{{ $v.port }}
        - --capacity={{ int64 $v.capacity }}
        - --redis-url=$(TANDEM_REDIS_URL)
        - --node-id=$(TANDEM_POD_NAME)
        - --metrics-port={{ $v.metricsPort }}
        {{- if $v.disk.enabled }}
        - --disk-path={{ $v.disk.mountPath }}
        - --disk-capacity={{ int64 $v.disk.capacity }}
        {{- end }}
        {{- with (include "tandem.tracingArgs" $root | trim) }}
        {{- . | nindent 8 }}
        {{- end }}
        {{- with $v.extraArgs }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      ports:
        - name: ucx
          containerPort: {{ $v.port }}
          {{- if eq $v.kind "DaemonSet" }}
          # Prefill and decode reach the store on their own node at $(TANDEM_HOST_IP).
          hostPort: {{ $v.port }}
          {{- end }}
          protocol: TCP
        - name: metrics
          containerPort: {{ $v.metricsPort }}
          protocol: TCP
      envFrom:
        {{- include "tandem.envFrom" $root | nindent 8 }}
      env:
        {{- include "tandem.env" $root | nindent 8 }}
      startupProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 5
        failureThreshold: 60
      readinessProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 10
        failureThreshold: 3
      livenessProbe:
        httpGet:
          path: /health
          port: metrics
        periodSeconds: 20
        timeoutSeconds: 5
        failureThreshold: 3
      resources:
        {{- include "tandem.kvstore.resources" $root | nindent 8 }}
      securityContext:
        {{- include "tandem.containerSecurityContext" $root | nindent 8 }}
      volumeMounts:
        {{- include "tandem.shmVolumeMount" $root | nindent 8 }}
        {{- if $v.disk.enabled }}
        - name: kv-disk
          mountPath: {{ $v.disk.mountPath }}
        {{- end }}
  volumes:
    {{- include "tandem.shmVolume" $root | nindent 4 }}
    {{- if $v.disk.enabled }}
    - name: kv-disk
      {{- if $v.disk.hostPath }}
      hostPath:
        path: {{ $v.disk.hostPath }}
        type: DirectoryOrCreate
      {{- else }}
      # NOTE: headroom over --disk-capacity for file headers and writes in flight, so
      # that the kubelet never evicts the pod for its own cache
      emptyDir:
        sizeLimit: {{ add (int64 $v.disk.capacity) (div (int64 $v.disk.capacity) 10) }}
      {{- end }}
    {{- end }}
{{- end }}
