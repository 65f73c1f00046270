// The status page: polls /status.json and redraws. No libraries, no external requests.
"use strict";
(function () {
  const $ = (id) => document.getElementById(id);
  const pct = (x) => (100 * x).toFixed(1) + " %";
  function size(n) {
    if (n === null || n === undefined) return "–";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let i = 0;
    while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
    return (i ? n.toFixed(1) : String(n)) + " " + units[i];
  }
  function cell(row, text, cls) {
    const td = document.createElement("td");
    td.textContent = text;
    if (cls) td.className = cls;
    row.appendChild(td);
    return td;
  }
  function bar(row, share) {
    const td = cell(row, "");
    const outer = document.createElement("div");
    outer.className = "bar";
    const inner = document.createElement("div");
    inner.style.width = Math.max(0, Math.min(100, 100 * share)).toFixed(1) + "%";
    outer.appendChild(inner);
    td.appendChild(outer);
  }
  function fill(tableId, rows) {
    const body = document.querySelector("#" + tableId + " tbody");
    body.replaceChildren();
    rows.forEach((fn) => { const tr = document.createElement("tr"); fn(tr); body.appendChild(tr); });
  }
  function median(xs) {
    if (!xs.length) return null;
    const s = xs.slice().sort((a, b) => a - b);
    return s[Math.floor((s.length - 1) / 2)];
  }
  const ns = "http://www.w3.org/2000/svg";
  function svgEl(svg, tag, attrs, text) {
    const el = document.createElementNS(ns, tag);
    for (const [k, v] of Object.entries(attrs)) el.setAttribute(k, String(v));
    if (text !== undefined) el.textContent = text;
    svg.appendChild(el);
    return el;
  }
  function chart(recent) {
    const svg = $("chart");
    svg.replaceChildren();
    // drawn in the svg's own pixels (no stretching), so the axis labels keep their shape
    const w = Math.max(300, Math.round(svg.getBoundingClientRect().width) || 600), h = 200;
    svg.setAttribute("viewBox", "0 0 " + w + " " + h);
    const left = 44, right = w - 12, top = 10, bottom = h - 34;
    const yAt = (v) => bottom - (bottom - top) * v;
    // each point: the 10 requests up to and including that one
    const ok = recent.filter((r) => r.outcome === "ok");
    const span = 10, points = { hit: [], share: [] };
    ok.forEach((_, i) => {
      const win = ok.slice(Math.max(0, i + 1 - span), i + 1);
      const prompt = win.reduce((a, r) => a + r.prompt_tokens, 0);
      const cached = win.reduce((a, r) => a + r.cached_tokens, 0);
      points.hit.push(win.filter((r) => r.hit).length / win.length);
      points.share.push(prompt ? cached / prompt : 0);
    });
    const step = ok.length > 1 ? (right - left) / (ok.length - 1) : 0;
    const xAt = (i) => left + i * step;
    // y axis: 0 to 100 % in quarters
    for (const v of [0, 0.25, 0.5, 0.75, 1]) {
      svgEl(svg, "line", { x1: left, x2: right, y1: yAt(v), y2: yAt(v), stroke: v ? "#e4e7eb" : "#8a94a3" });
      svgEl(svg, "text", { x: left - 6, y: yAt(v) + 4, "text-anchor": "end", class: "tick y" }, (100 * v) + " %");
    }
    svgEl(svg, "line", { x1: left, x2: left, y1: top, y2: bottom, stroke: "#8a94a3" });
    // x axis: the requests' times, at most five ticks
    const ticks = ok.length > 1 ? Math.min(5, ok.length) : ok.length;
    for (let t = 0; t < ticks; t++) {
      const i = ticks > 1 ? Math.round(t * (ok.length - 1) / (ticks - 1)) : 0;
      const x = xAt(i), anchor = ticks > 1 && t === 0 ? "start" : t === ticks - 1 && ticks > 1 ? "end" : "middle";
      svgEl(svg, "line", { x1: x, x2: x, y1: bottom, y2: bottom + 4, stroke: "#8a94a3" });
      svgEl(svg, "text", { x: x, y: bottom + 16, "text-anchor": anchor, class: "tick x" },
        new Date(ok[i].at * 1000).toLocaleTimeString());
    }
    svgEl(svg, "text", { x: (left + right) / 2, y: h - 3, "text-anchor": "middle", class: "axis" },
      ok.length ? "when each request finished (" + ok.length + " requests)" : "no requests yet");
    for (const key of ["hit", "share"]) {
      const xy = points[key].map((y, i) => [xAt(i), yAt(y)]);
      svgEl(svg, "polyline", { class: "line " + key,
        points: xy.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" ") });
      if (xy.length) {
        const [x, y] = xy[xy.length - 1];
        svgEl(svg, "circle", { class: "line " + key, cx: x.toFixed(1), cy: y.toFixed(1), r: 3 });
      }
    }
  }
  function render(d) {
    const t = d.totals;
    $("model").textContent = d.server.model;
    $("updated").textContent = "updated " + new Date(d.now * 1000).toLocaleTimeString();
    $("requests").textContent = String(t.requests) + (t.errors ? " (" + t.errors + " failed)" : "");
    $("hit-rate").textContent = pct(t.hit_rate);
    // the rule is the server's (skippy_llama.counters.HIT_SHARE), not repeated here
    $("hit-rule").textContent = "a hit reused ≥ " + Math.round(100 * t.hit_share) + " % of its prompt; "
      + t.short_matches + " shorter match" + (t.short_matches === 1 ? "" : "es");
    $("cached-share").textContent = pct(t.cached_share);
    $("prompt-tokens").textContent = String(t.prompt_tokens);
    $("cached-tokens").textContent = String(t.cached_tokens);
    const ttft = median(d.recent.filter((r) => r.outcome === "ok").map((r) => r.ttft_ms));
    $("ttft-p50").textContent = ttft === null ? "–" : ttft.toFixed(1) + " ms";
    $("prepared").textContent = String(d.counters.turns_prepared || 0);
    const mem = d.server.memory, q = d.server.queue;
    $("memory").textContent = mem ? size(mem.budget_bytes) : "not sized";
    $("memory-detail").textContent = mem
      ? "≈ " + mem.conversations + " conversations of " + mem.n_ctx + " tokens" + (mem.capped ? " (capped)" : "")
      : "";
    $("queue").textContent = q ? q.running_or_waiting + " / " + (q.max_queue + 1) : "–";
    $("queue-detail").textContent = q ? "running + waiting of at most " + (q.max_queue + 1) + "; " + q.rejected + " refused (503)" : "";
    const l1 = d.l1, l2 = d.l2, l3 = d.l3;
    fill("tiers", [
      (tr) => { cell(tr, "L1 resident"); cell(tr, l1.enabled ? "on" : "off");
        cell(tr, l1.tokens + " tokens"); cell(tr, l1.budget_tokens + " tokens");
        bar(tr, l1.budget_tokens ? l1.tokens / l1.budget_tokens : 0); cell(tr, l1.prefixes + " prefixes"); },
      (tr) => { cell(tr, "L2 RAM"); cell(tr, l2.enabled ? "on" : "off");
        cell(tr, size(l2.used_bytes || 0)); cell(tr, size(l2.budget_bytes || 0));
        bar(tr, l2.budget_bytes ? l2.used_bytes / l2.budget_bytes : 0); cell(tr, (l2.pages || 0) + " pages"); },
      (tr) => { cell(tr, "L3 disk"); cell(tr, l3.state + (l3.reason ? " (" + l3.reason + ")" : ""), "state-" + l3.state);
        cell(tr, size(l3.used_bytes || 0)); cell(tr, size(l3.budget_bytes || 0));
        bar(tr, l3.budget_bytes ? l3.used_bytes / l3.budget_bytes : 0);
        cell(tr, (l3.manifests || 0) + " prefixes, " + (l3.pages || 0) + " pages"); },
    ]);
    const tiers = ["l1", "l2", "l3", "cold"];
    const served = tiers.reduce((a, k) => a + (t.by_tier[k] || 0), 0);
    fill("sources", tiers.map((k) => (tr) => {
      cell(tr, k); cell(tr, String(t.by_tier[k] || 0)); bar(tr, served ? (t.by_tier[k] || 0) / served : 0);
    }));
    const fb = Object.entries(d.counters.fallbacks);
    fill("fallbacks", fb.length ? fb.map(([k, v]) => (tr) => { cell(tr, k); cell(tr, String(v)); })
      : [(tr) => { cell(tr, "none"); cell(tr, "0"); }]);
    fill("recent", d.recent.slice(-15).reverse().map((r) => (tr) => {
      cell(tr, new Date(r.at * 1000).toLocaleTimeString()); cell(tr, r.endpoint); cell(tr, r.tier);
      cell(tr, r.cached_tokens + "/" + r.prompt_tokens); cell(tr, r.ttft_ms.toFixed(1));
      cell(tr, size(r.restored_bytes)); cell(tr, r.outcome);
    }));
    chart(d.recent);
    document.body.dataset.loaded = String(t.requests);
  }
  async function poll() {
    try {
      const res = await fetch("status.json", { cache: "no-store" });
      if (res.ok) render(await res.json());
      else $("updated").textContent = "status.json: HTTP " + res.status;
    } catch (e) {
      $("updated").textContent = "server unreachable";
    }
    setTimeout(poll, 2000);
  }
  poll();
})();
