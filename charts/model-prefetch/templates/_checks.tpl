{{/*
The agent's rules about several keys at once, which a JSON Schema cannot say (values.schema.json
checks every key alone): without these the chart would render a config every agent refuses at
start, and every node would crash-loop. The messages are the agent's (prefetch/agent/config.py),
with "config." in front; tests/test_helm_chart.py renders each case and parses it with the agent.
*/}}

{{/* A duration the schema accepted (seconds, or steps like 1h30m), in seconds. */}}
{{- define "model-prefetch.seconds" -}}
{{- if kindIs "string" . -}}
{{- $units := dict "ms" 0.001 "s" 1.0 "m" 60.0 "h" 3600.0 "d" 86400.0 -}}
{{- $total := 0.0 -}}
{{- range $step := regexFindAll "[0-9]+(\\.[0-9]+)?(ms|s|m|h|d)" . -1 -}}
{{- $unit := regexFind "(ms|s|m|h|d)$" $step -}}
{{- $total = addf $total (mulf (float64 (trimSuffix $unit $step)) (get $units $unit)) -}}
{{- end -}}
{{- $total -}}
{{- else -}}
{{- float64 . -}}
{{- end -}}
{{- end -}}

{{- define "model-prefetch.checkConfig" -}}
{{- $c := .Values.config | default dict -}}
{{- if eq (atoi (include "model-prefetch.port" .)) 0 -}}
{{- fail "config.listen: port 0 (any free port) leaves the container port and the probes without one: give a port" -}}
{{- end -}}
{{- with $c.retryBackoff -}}
{{- /* the agent's defaults: Backoff in prefetch/agent/config.py */ -}}
{{- $initial := float64 (include "model-prefetch.seconds" (default "10s" .initial)) -}}
{{- $max := float64 (include "model-prefetch.seconds" (default "10m" .max)) -}}
{{- if lt $max $initial -}}
{{- fail "config.retryBackoff.max: must not be shorter than config.retryBackoff.initial (their defaults: 10s and 10m)" -}}
{{- end -}}
{{- end -}}
{{- $names := dict -}}
{{- $repos := dict -}}
{{- range $i, $m := $c.models | default list -}}
{{- if hasKey $names $m.name -}}
{{- fail (printf "config.models[%d].name: duplicate model name %q (also config.models[%s])" $i $m.name (get $names $m.name)) -}}
{{- end -}}
{{- $_ := set $names $m.name (toString $i) -}}
{{- $source := trim $m.source -}}
{{- $repo := "" -}}
{{- if hasPrefix "hf://" $source -}}
{{- $repo = regexReplaceAll "@.*$" (trimPrefix "hf://" $source) "" -}}
{{- else if $m.hfRepo -}}
{{- $repo = trim $m.hfRepo -}}
{{- end -}}
{{- if $repo -}}
{{- if hasKey $repos (lower $repo) -}}
{{- fail (printf "config.models[%d] (%s): same Hub repo as config.models[%s] (%s); one model per repo: merge their include patterns" $i $m.name (get $repos (lower $repo)) $repo) -}}
{{- end -}}
{{- $_ := set $repos (lower $repo) (toString $i) -}}
{{- end -}}
{{- end -}}
{{- $caches := dict -}}
{{- range $i, $cc := $c.compileCaches | default list -}}
{{- if hasKey $names $cc.name -}}
{{- fail (printf "config.compileCaches[%d].name: %q is also a model's name" $i $cc.name) -}}
{{- end -}}
{{- if hasKey $caches $cc.name -}}
{{- fail (printf "config.compileCaches[%d].name: duplicate compile cache name %q (also config.compileCaches[%s])" $i $cc.name (get $caches $cc.name)) -}}
{{- end -}}
{{- $_ := set $caches $cc.name (toString $i) -}}
{{- if and $cc.push (not (hasPrefix "/" (default "" $cc.pushFrom))) -}}
{{- fail (printf "config.compileCaches[%d].pushFrom: push: true needs the absolute path of the directory the vLLM pod writes this compile cache into" $i) -}}
{{- end -}}
{{- end -}}
{{- end -}}

{{/* Mirror jobs: each is a Job or CronJob of its own name in the release's namespace. */}}
{{- define "model-prefetch.checkMirror" -}}
{{- $jobs := dict -}}
{{- range $i, $job := .Values.mirror.jobs | default list -}}
{{- if hasKey $jobs $job.name -}}
{{- fail (printf "mirror.jobs[%d].name: duplicate job name %q (also mirror.jobs[%s])" $i $job.name (get $jobs $job.name)) -}}
{{- end -}}
{{- $_ := set $jobs $job.name (toString $i) -}}
{{- end -}}
{{- end -}}
