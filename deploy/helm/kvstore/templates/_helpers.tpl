{{/* Names, labels and the values the templates share. */}}

{{- define "kvstore.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "kvstore.fullname" -}}
{{- if .Values.fullnameOverride -}}
{{- .Values.fullnameOverride | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- $name := default .Chart.Name .Values.nameOverride -}}
{{- if contains $name .Release.Name -}}
{{- .Release.Name | trunc 40 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name $name | trunc 40 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Selector labels; call with (dict "root" $ "component" "agent"). */}}
{{- define "kvstore.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvstore.name" .root }}
app.kubernetes.io/instance: {{ .root.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end -}}

{{- define "kvstore.labels" -}}
{{ include "kvstore.selectorLabels" . }}
app.kubernetes.io/part-of: kvstore
app.kubernetes.io/version: {{ .root.Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .root.Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .root.Chart.Name .root.Chart.Version | replace "+" "_" }}
{{- with .root.Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end -}}

{{- define "kvstore.image" -}}
{{- include "kvstore.imageRef" (dict "image" .Values.image "tag" .Chart.AppVersion) -}}
{{- end -}}

{{/* repository[:tag][@digest] of an image section; dict: image, tag (the default tag).
     The schema holds tags and digests to the OCI grammar; the templates quote the result,
     so nothing in it can end or comment out the YAML value. */}}
{{- define "kvstore.imageRef" -}}
{{- $ref := .image.repository -}}
{{- with (.image.tag | default .tag) -}}
{{- $ref = printf "%s:%s" $ref . -}}
{{- end -}}
{{- with .image.digest -}}
{{- $ref = printf "%s@%s" $ref . -}}
{{- end -}}
{{- $ref -}}
{{- end -}}

{{- define "kvstore.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "kvstore.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.etcdName" -}}
{{- printf "%s-etcd" (include "kvstore.fullname" .) -}}
{{- end -}}

{{/* host:port[,host:port] the agents, routers and kvctl dial. Bundled etcd: every member
     through the headless Service, so a client fails over without a proxy. */}}
{{- define "kvstore.etcdEndpoints" -}}
{{- if eq .Values.etcd.mode "external" -}}
{{- if not .Values.etcd.external.endpoints -}}
{{- fail "etcd.mode is external but etcd.external.endpoints is empty" -}}
{{- end -}}
{{- if .Values.tls.etcdPeers -}}
{{- fail (printf "tls.etcdPeers (%s) applies to the bundled etcd's members only; with etcd.mode external, how its members talk to each other is that etcd's own configuration: leave tls.etcdPeers empty" .Values.tls.etcdPeers) -}}
{{- end -}}
{{- join "," .Values.etcd.external.endpoints -}}
{{- else -}}
{{- /* One name for every member: the headless Service resolves to all of their
     addresses, and gRPC re-resolves it when connections fail (kvstore/coord/etcd.py
     channel_target; one channel cannot balance over several names). */ -}}
{{- $name := include "kvstore.etcdName" . -}}
{{- printf "%s-headless.%s.svc:2379" $name .Release.Namespace -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.tenantsSecretName" -}}
{{- default (printf "%s-tenants" (include "kvstore.fullname" .)) .Values.auth.existingSecret -}}
{{- end -}}

{{/* Tenants for inference workers (the chart's own "_cluster" entry does not count). */}}
{{- define "kvstore.hasTenants" -}}
{{- if or .Values.auth.existingSecret .Values.auth.tenants -}}true{{- end -}}
{{- end -}}

{{- define "kvstore.clusterTokenSecretName" -}}
{{- default (printf "%s-cluster-token" (include "kvstore.fullname" .)) .Values.auth.existingClusterTokenSecret -}}
{{- end -}}

{{/* The agent credential (identity "_agent", docs/security.md): a Secret the chart renders
     unless auth.existingSecret is yours, then only auth.existingAgentTokenSecret. */}}
{{- define "kvstore.agentTokenSecretName" -}}
{{- default (printf "%s-agent-token" (include "kvstore.fullname" .)) .Values.auth.existingAgentTokenSecret -}}
{{- end -}}

{{- define "kvstore.hasAgentToken" -}}
{{- if or (not .Values.auth.existingSecret) .Values.auth.existingAgentTokenSecret -}}true{{- end -}}
{{- end -}}

{{/* The engine record key (docs/security.md, Engine records): engines' registrars sign
     their etcd records with it, routers and gateways verify them. Key "key". */}}
{{- define "kvstore.engineRecordKeySecretName" -}}
{{- default (printf "%s-engine-record-key" (include "kvstore.fullname" .)) .Values.auth.existingEngineRecordKeySecret -}}
{{- end -}}

{{- define "kvstore.engineRecordKeyDir" -}}/etc/kvstore/engine-record-key{{- end -}}

{{/* The router.yaml of the release running now, read at `helm upgrade` ("" on install,
     and under `helm template`, which reaches no cluster). */}}
{{- define "kvstore.liveRouterConfig" -}}
{{- if .Release.IsUpgrade -}}
{{- dig "data" "router.yaml" "" (lookup "v1" "ConfigMap" .Release.Namespace (printf "%s-config" (include "kvstore.fullname" .))) -}}
{{- end -}}
{{- end -}}

{{/* auth.engineRecords as it applies (verify, sign or unsigned; values.yaml says what
     each does). "" keeps what the running release does (router.yaml records it), so an
     upgrade never changes how engine records are trusted unless told: verify on install
     and after a release that verified; sign after a release from before engine records
     were signed (its routers held no key), so routers that restart within seconds of
     the upgrade keep taking the engines' unsigned records while the engines restart,
     one by one, to sign theirs. */}}
{{- define "kvstore.engineRecords" -}}
{{- $mode := .Values.auth.engineRecords -}}
{{- if not $mode -}}
{{- $live := include "kvstore.liveRouterConfig" . -}}
{{- $was := regexFind "auth.engineRecords: [a-z]+" $live | trimPrefix "auth.engineRecords: " -}}
{{- if not $live -}}
{{- $mode = "verify" -}}
{{- else if not (contains "engine_record_key_file:" $live) -}}
{{- $mode = "sign" -}}
{{- else -}}
{{- $mode = $was | default "verify" -}}
{{- end -}}
{{- end -}}
{{- $mode -}}
{{- end -}}

{{/* The peer scheme the running release's etcd members serve ("https" or "http", from
     its StatefulSet's --listen-peer-urls), read at `helm upgrade`; "data" where there is
     no StatefulSet but its first member's data volume is there (a reinstall that kept
     the volumes: the peer URLs recorded in them are unknown); "" on install and under
     `helm template`, which reaches no cluster (GitOps tools that render with it must
     set tls.etcdPeers: values.yaml). */}}
{{- define "kvstore.liveEtcdPeerScheme" -}}
{{- $name := include "kvstore.etcdName" . -}}
{{- $live := lookup "apps/v1" "StatefulSet" .Release.Namespace $name | default dict -}}
{{- $args := list -}}
{{- range (dig "spec" "template" "spec" "containers" list $live) -}}
{{- $args = concat $args (.args | default list) -}}
{{- end -}}
{{- if has "--listen-peer-urls=https://0.0.0.0:2380" $args -}}
https
{{- else if has "--listen-peer-urls=http://0.0.0.0:2380" $args -}}
http
{{- else if and (not $live) (lookup "v1" "PersistentVolumeClaim" .Release.Namespace (printf "data-%s-0" $name)) -}}
data
{{- end -}}
{{- end -}}

{{/* How the bundled etcd's members reach each other: "https" (mutual TLS with the
     release's pair, as their clients do) or "http". tls.etcdPeers: tls or plaintext; ""
     keeps what the running members do, tls on install. etcd records each member's peer
     URL in its data when the cluster is made and ignores the flag afterwards, so a
     change of scheme alone would cut the members off from each other: the chart never
     makes one by itself, and refuses to let turning TLS off make one unannounced (chart
     README, "Upgrading: etcd peers to TLS"). */}}
{{- define "kvstore.etcdPeerScheme" -}}
{{- $mode := .Values.tls.etcdPeers -}}
{{- $live := include "kvstore.liveEtcdPeerScheme" . -}}
{{- if not (and .Values.tls.enabled .Values.tls.etcd) -}}
{{- if eq $mode "tls" -}}
{{- fail "tls.etcdPeers is tls, but etcd's members can only talk TLS with tls.enabled and tls.etcd true" -}}
{{- else if and (eq $live "https") (ne $mode "plaintext") -}}
{{- fail "the bundled etcd's members talk to each other over TLS, and etcd keeps their https:// peer URLs in its data: turning tls.enabled or tls.etcd off alone would cut them off from each other. Set tls.etcdPeers=plaintext to go on, then record each member's http:// peer URL as it restarts (chart README, \"Upgrading: etcd peers to TLS\", the steps in reverse)" -}}
{{- end -}}
http
{{- else if eq $mode "tls" -}}
https
{{- else if eq $mode "plaintext" -}}
http
{{- else if eq $live "http" -}}
http
{{- else if eq $live "data" -}}
{{- fail (printf "the bundled etcd's data volumes (data-%s-*) are there without its StatefulSet: the peer URLs its members recorded in them are unknown to the chart, and the wrong scheme would cut them off from each other. Set tls.etcdPeers to what they were made with: plaintext for a release before peers used TLS or with tls.etcdPeers=plaintext, tls otherwise" (include "kvstore.etcdName" .)) -}}
{{- else -}}
https
{{- end -}}
{{- end -}}

{{/* The volume and mount of the engine record key, for routers, gateways and engines. */}}
{{- define "kvstore.engineRecordKeyVolume" -}}
- name: engine-record-key
  secret:
    secretName: {{ include "kvstore.engineRecordKeySecretName" . }}
    defaultMode: 0440
    items:
      - key: key
        path: key
{{- end -}}

{{- define "kvstore.engineRecordKeyMount" -}}
- name: engine-record-key
  mountPath: {{ include "kvstore.engineRecordKeyDir" . }}
  readOnly: true
{{- end -}}

{{- define "kvstore.atRestSecretName" -}}
{{- default (printf "%s-at-rest" (include "kvstore.fullname" .)) .Values.encryption.existingSecret -}}
{{- end -}}

{{- define "kvstore.tlsSecretName" -}}
{{- default (printf "%s-tls" (include "kvstore.fullname" .)) .Values.tls.existingSecret -}}
{{- end -}}

{{/* Device string of agent container $i: the device plugin exposes a container's one GPU
     as cuda:0; without it every container sees all GPUs and takes cuda:<i>. */}}
{{- define "kvstore.agentDevice" -}}
{{- $v := .root.Values.agent -}}
{{- if eq $v.device "cpu" -}}cpu
{{- else if $v.gpuResourceName -}}cuda:0
{{- else -}}{{ printf "cuda:%d" (int .index) }}
{{- end -}}
{{- end -}}

{{/* Host memory limit of one agent container, in MiB: the pool lives in host memory when
     the device is cpu, so the limit must cover it. */}}
{{- define "kvstore.agentMemoryMiB" -}}
{{- $v := .Values.agent -}}
{{- if eq $v.device "cpu" -}}
{{- add (int $v.poolMiB) (int $v.memoryOverheadMiB) -}}
{{- else -}}
{{- int $v.memoryOverheadMiB -}}
{{- end -}}
{{- end -}}

{{/* What an agent's max_message_bytes must hold, in KiB (kvstore.config
     _check_message_bytes): a client's Put message (4 MiB of blocks, at most 8 slots, at
     least one slot) or one request's ids (32 bytes each), plus 64 KiB. */}}
{{- define "kvstore.agentMessageNeedKiB" -}}
{{- $v := .Values.agent -}}
{{- $slot := int $v.slotKiB -}}
{{- $put := max $slot (min (mul 8 $slot) 4096) -}}
{{- $ids := div (add (mul 32 (int $v.maxBlocksPerRequest)) 1023) 1024 -}}
{{- add (max $put $ids) 64 -}}
{{- end -}}

{{/* agent.maxMessageMiB as rendered: "auto" is 8, or what the slot and the request's ids
     need where that is more (a large slotKiB would otherwise stop the agent at start). */}}
{{- define "kvstore.agentMessageMiB" -}}
{{- $m := .Values.agent.maxMessageMiB -}}
{{- if eq (toString $m) "auto" -}}
{{- max 8 (div (add (include "kvstore.agentMessageNeedKiB" . | int) 1023) 1024) -}}
{{- else -}}
{{- int $m -}}
{{- end -}}
{{- end -}}

{{/* The agents' data dir on the node (storage.type hostPath). */}}
{{- define "kvstore.agentHostPath" -}}
{{- printf "%s/%s/%s" (trimSuffix "/" .Values.agent.storage.hostPath.path) .Release.Namespace (include "kvstore.fullname" .) -}}
{{- end -}}

{{- define "kvstore.localVolumeGiB" -}}
{{- $v := .Values.agent -}}
{{- $need := mul (int $v.nvmeGiB) (int $v.gpusPerNode) -}}
{{- $size := int $v.storage.localPersistentVolume.sizeGiB -}}
{{- if eq $size 0 -}}
{{- max 1 (div (mul $need 5) 4) -}}
{{- else if lt $size $need -}}
{{- fail (printf "agent.storage.localPersistentVolume.sizeGiB (%d) is smaller than nvmeGiB x gpusPerNode (%d)" $size $need) -}}
{{- else -}}
{{- $size -}}
{{- end -}}
{{- end -}}

{{- define "kvstore.policy" -}}
ttl_seconds: {{ .ttlSeconds | float64 }}
min_prefix_blocks: {{ .minPrefixBlocks | int }}
persist: {{ .persist }}
pin_budget_bytes: {{ printf "%dMiB" (int .pinBudgetMiB) | quote }}
{{- end -}}

{{/* Restricted-profile container securityContext shared by every long-running container. */}}
{{- define "kvstore.containerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop: ["ALL"]
{{- end -}}

{{/* The gateway's Secret: API keys (keys.json), the engines' chain-root secret
     (kv.secret) and the cache_salt key (salt.key). */}}
{{- define "kvstore.gatewaySecretName" -}}
{{- printf "%s-gateway" (include "kvstore.fullname" .) -}}
{{- end }}

{{/* The `tls:` section of agent.yaml and router.yaml (kvstore.config.TLSConfig): the
     mounted Secret's files; server_name is the name every process's certificate
     carries (agents are dialled by pod IP, which one shared certificate cannot name). */}}
{{- define "kvstore.tlsConfig" -}}
{{- if .Values.tls.enabled -}}
tls:
  ca_file: {{ printf "%s/ca.crt" .Values.tls.mountPath | quote }}
  cert_file: {{ printf "%s/tls.crt" .Values.tls.mountPath | quote }}
  key_file: {{ printf "%s/tls.key" .Values.tls.mountPath | quote }}
  server_name: {{ include "kvstore.tlsServerName" . | quote }}
  etcd: {{ .Values.tls.etcd }}
{{- end -}}
{{- end -}}

{{- define "kvstore.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "kvstore.fullname" .) .Release.Namespace) .Values.tls.serverName -}}
{{- end -}}

{{/* A gRPC health probe: the kubelet's native one, or, with mTLS (the kubelet cannot
     present a client certificate), the image's kvstore-health with the mounted pair.
     dict: root, port, service (optional). */}}
{{- define "kvstore.grpcProbe" -}}
{{- $t := .root.Values.tls -}}
{{- if $t.enabled -}}
exec:
  command:
    - /opt/kvstore/bin/kvstore-health
    - {{ printf "127.0.0.1:%v" .port | quote }}
    {{- with .service }}
    - --service={{ . }}
    {{- end }}
    - --tls-ca={{ $t.mountPath }}/ca.crt
    - --tls-cert={{ $t.mountPath }}/tls.crt
    - --tls-key={{ $t.mountPath }}/tls.key
    - --tls-server-name={{ include "kvstore.tlsServerName" .root }}
{{- else -}}
grpc:
  port: {{ .port }}
  {{- with .service }}
  service: {{ . }}
  {{- end }}
{{- end -}}
{{- end -}}

{{/* The gateway's HTTP probe: GET /health (HTTPS with gateway.https), or, when clients
must present a certificate (which the kubelet cannot), a TCP check of the port. */}}
{{- define "kvstore.gatewayProbe" -}}
{{- $g := .Values.gateway -}}
{{- if $g.requireClientCert }}
tcpSocket:
  port: http
{{- else }}
httpGet:
  path: /health
  port: http
  scheme: {{ ternary "HTTPS" "HTTP" $g.https }}
{{- end }}
{{- end }}

{{/* Fails when two ports one pod listens on are equal (two processes of one network
     namespace cannot bind one port; hostPorts of one node neither). dict: pod (where the
     ports meet, for the message), ports (a list of [value name, port]; port 0: none). */}}
{{- define "kvstore.distinctPorts" -}}
{{- $seen := dict -}}
{{- range .ports -}}
{{- $name := index . 0 -}}
{{- $port := int (index . 1) -}}
{{- if $port -}}
{{- $key := toString $port -}}
{{- if hasKey $seen $key -}}
{{- fail (printf "ports overlap in the %s: %s and %s are both port %d; change one of them" $.pod (get $seen $key) $name $port) -}}
{{- end -}}
{{- $_ := set $seen $key $name -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* [value name, port] pairs for the ports base + i, i < count: "name" for i = 0, then
     "name + i". dict: name, base, count. */}}
{{- define "kvstore.portRange" -}}
{{- $out := list -}}
{{- range $i := until (int .count) -}}
{{- $name := ternary $.name (printf "%s + %d" $.name $i) (eq $i 0) -}}
{{- $port := add (int $.base) $i -}}
{{- if gt $port 65535 -}}
{{- fail (printf "%s is %d, beyond the last port (65535): lower %s (container %d of %d needs base + %d)" $name $port $.name $i (int $.count) $i) -}}
{{- end -}}
{{- $out = append $out (list $name $port) -}}
{{- end -}}
{{- toJson $out -}}
{{- end -}}

{{/* The PodDisruptionBudget of the router or gateway Deployment. The replicas it guards
     are the fewest the Deployment runs: replicas, or autoscaling.minReplicas under an
     HPA. A budget that keeps every one of them (minAvailable >= that count; a
     percentage rounds up, as Kubernetes rounds it) blocks every eviction, so no node
     that runs one could be drained: with one replica no budget is rendered (none for
     one pod could allow its eviction), with more the chart refuses, naming the values.
     dict: root, component ("router" or "gateway"). */}}
{{- define "kvstore.podDisruptionBudget" -}}
{{- $v := index .root.Values .component -}}
{{- $pdb := $v.podDisruptionBudget -}}
{{- if $pdb.enabled -}}
{{- $hpa := $v.autoscaling.enabled -}}
{{- $replicas := int (ternary $v.autoscaling.minReplicas $v.replicas $hpa) -}}
{{- $replicasName := printf "%s.%s" .component (ternary "autoscaling.minReplicas" "replicas" $hpa) -}}
{{- $min := $pdb.minAvailable -}}
{{- $keep := 0 -}}
{{- $shown := toString $min -}}
{{- if typeIs "string" $min -}}
{{- $keep = div (add (mul $replicas (int (trimSuffix "%" $min))) 99) 100 -}}
{{- $shown = printf "%s, %d pods" $min (int $keep) -}}
{{- else -}}
{{- $keep = int $min -}}
{{- end -}}
{{- if lt (int $keep) $replicas -}}
apiVersion: policy/v1
kind: PodDisruptionBudget
metadata:
  name: {{ include "kvstore.fullname" .root }}-{{ .component }}
  namespace: {{ .root.Release.Namespace }}
  labels:
    {{- include "kvstore.labels" (dict "root" .root "component" .component) | nindent 4 }}
spec:
  minAvailable: {{ $min }}
  selector:
    matchLabels:
      {{- include "kvstore.selectorLabels" (dict "root" .root "component" .component) | nindent 6 }}
{{- else if gt $replicas 1 -}}
{{- fail (printf "%s.podDisruptionBudget.minAvailable (%s) is not below %s (%d): the budget would block every eviction, so no node running a %s pod could be drained; lower minAvailable, raise %s, or set %s.podDisruptionBudget.enabled=false" .component $shown $replicasName $replicas .component $replicasName .component) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* The Prometheus pages hold every tenant's counts: scrapers present a bearer token
     (metrics.token, a Secret of its own) unless metrics.open. */}}
{{- define "kvstore.metricsTokenSecretName" -}}
{{- default (printf "%s-metrics-token" (include "kvstore.fullname" .)) .Values.metrics.existingTokenSecret -}}
{{- end -}}

{{- define "kvstore.metricsGuarded" -}}
{{- if not .Values.metrics.open -}}true{{- end -}}
{{- end -}}

{{/* agent.yaml / router.yaml: how the page is guarded (the file alone is complete). */}}
{{- define "kvstore.metricsConfig" -}}
{{- if include "kvstore.metricsGuarded" . -}}
metrics_token_file: /etc/kvstore/metrics-token/token
{{- else -}}
metrics_open: true
{{- end -}}
{{- end -}}

{{- define "kvstore.metricsMount" -}}
{{- if include "kvstore.metricsGuarded" . }}
- name: metrics-token
  mountPath: /etc/kvstore/metrics-token
  readOnly: true
{{- end }}
{{- end -}}

{{- define "kvstore.metricsVolume" -}}
{{- if include "kvstore.metricsGuarded" . }}
- name: metrics-token
  secret:
    secretName: {{ include "kvstore.metricsTokenSecretName" . }}
    defaultMode: 0440
{{- end }}
{{- end -}}

{{/* A ServiceMonitor endpoint's authorization (Prometheus Operator). */}}
{{- define "kvstore.metricsAuthorization" -}}
{{- if include "kvstore.metricsGuarded" . }}
authorization:
  type: Bearer
  credentials:
    name: {{ include "kvstore.metricsTokenSecretName" . }}
    key: token
{{- end }}
{{- end -}}

{{/* A CPU quantity ("500m", "2", "1.5") in millicores, to compare a request with a limit. */}}
{{- define "kvstore.milliCPU" -}}
{{- $q := toString . -}}
{{- if hasSuffix "m" $q -}}
{{- trimSuffix "m" $q | int -}}
{{- else -}}
{{- mulf (float64 $q) 1000 | int -}}
{{- end -}}
{{- end -}}

