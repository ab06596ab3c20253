// tokenmill's dashboard: one EventSource on /dashboard/events (a JSON snapshot of metrics/live.py's
// LiveStats a second), drawn into the page's numbers, SVG gauges and canvas charts. No libraries.
"use strict";

const $ = (id) => document.getElementById(id);
const css = (name) => getComputedStyle(document.documentElement).getPropertyValue(name).trim();

function fmt(value, digits) {
  if (value === null || value === undefined || Number.isNaN(value)) return "-";
  if (typeof value !== "number") return String(value);
  if (digits === undefined) return Number.isInteger(value) ? value.toLocaleString("en-US") : value.toFixed(2);
  return value.toFixed(digits);
}
const pct = (v) => (v === null || v === undefined ? "-" : (100 * v).toFixed(1) + "%");

function setText(id, text) {
  const el = $(id);
  if (el && el.textContent !== text) el.textContent = text;
}

function drawGauge(svg, ratio) {
  const r = 50, cx = 60, cy = 60;
  const arc = (from, to, color, width) => {
    const a0 = Math.PI * (1 - from), a1 = Math.PI * (1 - to);
    const x0 = cx + r * Math.cos(a0), y0 = cy - r * Math.sin(a0);
    const x1 = cx + r * Math.cos(a1), y1 = cy - r * Math.sin(a1);
    return `<path d="M ${x0} ${y0} A ${r} ${r} 0 0 1 ${x1} ${y1}" stroke="${color}" stroke-width="${width}" fill="none" stroke-linecap="round"/>`;
  };
  const v = ratio === null || ratio === undefined ? 0 : Math.max(0, Math.min(1, ratio));
  const color = v > 0.7 ? "#16a34a" : v > 0.4 ? "#f59e0b" : "#dc2626";
  svg.innerHTML = arc(0, 1, "#e5e7eb", 10) + (v > 0.001 ? arc(0, v, color, 10) : "");
}

function prepare(canvas) {
  const ctx = canvas.getContext("2d");
  ctx.clearRect(0, 0, canvas.width, canvas.height);
  ctx.font = "11px system-ui, sans-serif";
  return ctx;
}

function axisMax(values) {
  const m = Math.max(1, ...values);
  const p = Math.pow(10, Math.floor(Math.log10(m)));
  return Math.ceil(m / p) * p;
}

function drawLines(canvas, series, colors) {
  const ctx = prepare(canvas), w = canvas.width, h = canvas.height, pad = 36;
  const n = series[0].length;
  const top = axisMax(series.flat());
  ctx.strokeStyle = "#e3e6ea";
  ctx.fillStyle = "#6b7280";
  for (let i = 0; i <= 4; i++) {
    const y = h - 16 - (h - 24) * i / 4;
    ctx.beginPath(); ctx.moveTo(pad, y); ctx.lineTo(w, y); ctx.stroke();
    ctx.fillText(fmt(top * i / 4, 0), 2, y + 4);
  }
  if (n < 2) return;
  series.forEach((values, k) => {
    ctx.strokeStyle = colors[k];
    ctx.lineWidth = 2;
    ctx.beginPath();
    values.forEach((v, i) => {
      const x = pad + (w - pad) * i / (n - 1), y = h - 16 - (h - 24) * v / top;
      if (i === 0) ctx.moveTo(x, y); else ctx.lineTo(x, y);
    });
    ctx.stroke();
  });
}

function drawBars(canvas, pairs) {
  const ctx = prepare(canvas), w = canvas.width, h = canvas.height, pad = 36;
  const top = axisMax(pairs.map(([p, d]) => p + d));
  ctx.fillStyle = "#6b7280";
  ctx.fillText(fmt(top, 0), 2, 12);
  ctx.fillText("0", 2, h - 16);
  const bw = (w - pad) / Math.max(pairs.length, 1);
  pairs.forEach(([prefill, decode], i) => {
    const x = pad + i * bw, scale = (h - 24) / top;
    ctx.fillStyle = css("--decode");
    ctx.fillRect(x, h - 16 - decode * scale, Math.max(1, bw - 1), decode * scale);
    ctx.fillStyle = css("--prefill");
    ctx.fillRect(x, h - 16 - (decode + prefill) * scale, Math.max(1, bw - 1), prefill * scale);
  });
}

// one cell per block (per `per` blocks when there are more than fit), in use first, then cached, then free
function drawKvMap(canvas, kv) {
  const ctx = prepare(canvas), w = canvas.width, h = canvas.height, cellMin = 6;
  const total = Math.max(kv.total, 1);
  const per = Math.max(1, Math.ceil(total / (Math.floor(w / cellMin) * Math.floor(h / cellMin))));
  const cells = Math.ceil(total / per);
  let size = Math.floor(Math.sqrt((w * h) / cells));
  while (size > cellMin && Math.floor(w / size) * Math.floor(h / size) < cells) size--;
  const perRow = Math.max(1, Math.floor(w / size));
  const used = kv.used / per, cached = kv.cached / per;
  for (let i = 0; i < cells; i++) {
    ctx.fillStyle = i < used ? css("--used") : i < used + cached ? css("--cached") : css("--free");
    ctx.fillRect((i % perRow) * size, Math.floor(i / perRow) * size, size - 1, size - 1);
  }
  canvas.title = per > 1 ? `one cell per ${per} blocks` : "one cell per block";
  setText("kv-scale", canvas.title);
}

// the second KV tier, one row per tier that is on: a fill bar (prefix blocks, swap reservations) and counts
function renderTiers(tiers) {
  const names = Object.keys(tiers || {});
  $("kv-tiers").hidden = names.length === 0;
  $("kv-tiers-off").hidden = names.length > 0;
  for (const name of ["memory", "disk"]) {
    const t = (tiers || {})[name];
    $("tier-" + name).hidden = !t;
    if (!t) continue;
    const mib = (b) => fmt(b / 1048576, 2);
    // every held block (prefix or swap) is the same size, so the swap share of the bytes is its share of the blocks
    const cap = Math.max(t.capacity_bytes, 1), held = t.cached_blocks + t.swap_blocks;
    const swapBytes = held ? (t.used_bytes * t.swap_blocks) / held : 0;
    const [cachedBar, swapBar] = $("tier-" + name).querySelectorAll(".bar span");
    cachedBar.style.width = (100 * Math.min(1, (t.used_bytes - swapBytes) / cap)).toFixed(1) + "%";
    swapBar.style.width = (100 * Math.min(1, swapBytes / cap)).toFixed(1) + "%";
    setText("tier-" + name + "-cached", fmt(t.cached_blocks));
    setText("tier-" + name + "-swap", fmt(t.swap_blocks));
    setText("tier-" + name + "-used", mib(t.used_bytes));
    setText("tier-" + name + "-capacity", mib(t.capacity_bytes));
    setText("tier-" + name + "-hits", fmt(t.hit_tokens));
  }
}

function render(s) {
  setText("model", s.model);
  setText("updated", new Date(s.time * 1000).toLocaleTimeString());
  setText("running", fmt(s.running));
  setText("waiting", fmt(s.waiting));
  setText("finished-requests", fmt(s.finished_requests));
  setText("generation-tokens", fmt(s.generation_tokens));
  setText("steps", fmt(s.steps));
  setText("prefix-hit-rate", pct(s.prefix_cache_hit_rate));
  setText("preemptions", fmt(s.num_preemptions));

  const win = s.window || {};
  setText("mbu", pct(s.mbu));
  setText("mfu", pct(s.mfu));
  drawGauge($("mbu-gauge"), s.mbu);
  drawGauge($("mfu-gauge"), s.mfu);
  setText("bandwidth", fmt(win.bandwidth_gbps, 2));
  setText("gflops", fmt(win.gflops, 1));
  setText("bandwidth-ceiling", fmt(s.bandwidth_ceiling_GBps, 1));
  setText("flops-ceiling", fmt(s.flops_ceiling_gflops, 1));
  setText("bandwidth-source", s.bandwidth_source ? "ceiling: " + s.bandwidth_source : "no ceiling: run tokenmill bench roofline");
  setText("flops-source", s.flops_source ? "ceiling: " + s.flops_source : "");
  $("bandwidth-raised").hidden = !s.bandwidth_ceiling_raised;
  $("flops-raised").hidden = !s.flops_ceiling_raised;

  const g = s.goodput;
  setText("goodput", g ? fmt(g.goodput_rps, 2) : "-");
  setText("slo", g ? g.slo : "no --slo given");
  setText("attainment", g ? pct(g.attainment) : "-");
  setText("slo-met", g ? fmt(g.met) : "-");
  setText("slo-requests", g ? fmt(g.requests) : "-");

  const plan = s.plan;
  setText("plan-floor", plan ? fmt(plan.decode_floor_ms, 3) : "-");
  setText("step-ms", fmt(win.step_ms, 3));
  setText("plan-capacity", plan ? fmt(plan.capacity_tokens) : "-");
  setText("plan-requests", plan ? fmt(plan.capacity_requests) : "-");
  setText("running-now", fmt(s.running));
  setText("kv-pool-tokens", plan ? fmt(s.kv_blocks.total * plan.block_size) : "-");
  setText("plan-note", plan ? `floor: batch 1 at ${plan.context} tokens of context; capacity: requests of ${plan.context} tokens` : "");

  const tp = s.throughput;
  drawLines($("throughput-chart"), [tp.map((r) => r[2]), tp.map((r) => r[1])], [css("--gen"), css("--prompt")]);
  drawBars($("composition-chart"), s.composition);
  setText("prefill-per-step", fmt(win.prefill_tokens_per_step, 1));
  setText("decode-per-step", fmt(win.decode_tokens_per_step, 1));

  drawKvMap($("kv-map"), s.kv_blocks);
  setText("kv-used", fmt(s.kv_blocks.used));
  setText("kv-cached", fmt(s.kv_blocks.cached));
  setText("kv-free", fmt(s.kv_blocks.free));
  setText("kv-total", fmt(s.kv_blocks.total));
  renderTiers(s.kv_tiers);

  for (const kind of ["ttft", "tpot", "itl"]) {
    const l = s.latency_ms[kind];
    for (const q of ["p50", "p90", "p99"]) setText(`${kind}-${q}`, fmt(l[q], 2));
    setText(`${kind}-n`, fmt(l.n));
  }
  document.body.dataset.snapshotTime = String(s.time);  // which snapshot the page shows (tests wait on it)
}

function connect() {
  const key = new URLSearchParams(window.location.search).get("api_key");
  const url = "events" + (key ? "?api_key=" + encodeURIComponent(key) : "");
  const source = new EventSource(url);
  const status = $("status");
  source.onmessage = (event) => {
    render(JSON.parse(event.data));
    status.textContent = "live";
    status.className = "status live";
  };
  source.onerror = () => {
    status.textContent = "reconnecting";
    status.className = "status stale";
  };
}

connect();
