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
  function chart(recent) {
    const svg = $("chart");
    svg.replaceChildren();
    // each point: the 10 requests up to and including that one
    const ok = recent.filter((r) => r.outcome === "ok");
    const span = 10, points = { hit: [], share: [] };
    ok.forEach((_, i) => {
      const win = ok.slice(Math.max(0, i + 1 - span), i + 1);
      const prompt = win.reduce((a, r) => a + r.prompt_tokens, 0);
      const cached = win.reduce((a, r) => a + r.cached_tokens, 0);
      points.hit.push(win.filter((r) => r.tier !== "cold").length / win.length);
      points.share.push(prompt ? cached / prompt : 0);
    });
    const ns = "http://www.w3.org/2000/svg";
    for (const y of [0, 0.5, 1]) {
      const line = document.createElementNS(ns, "line");
      line.setAttribute("x1", "0"); line.setAttribute("x2", "600");
      line.setAttribute("y1", String(170 - 160 * y)); line.setAttribute("y2", String(170 - 160 * y));
      line.setAttribute("stroke", "#e4e7eb");
      svg.appendChild(line);
    }
    for (const key of ["hit", "share"]) {
      const ys = points[key];
      const step = ys.length > 1 ? 580 / (ys.length - 1) : 0;
      const xy = ys.map((y, i) => [10 + i * step, 170 - 160 * y]);
      const path = document.createElementNS(ns, "polyline");
      path.setAttribute("class", "line " + key);
      path.setAttribute("points", xy.map(([x, y]) => x.toFixed(1) + "," + y.toFixed(1)).join(" "));
      svg.appendChild(path);
      if (xy.length) {
        const [x, y] = xy[xy.length - 1];
        const dot = document.createElementNS(ns, "circle");
        dot.setAttribute("class", "line " + key);
        dot.setAttribute("cx", x.toFixed(1)); dot.setAttribute("cy", y.toFixed(1)); dot.setAttribute("r", "3");
        svg.appendChild(dot);
      }
    }
  }
  function render(d) {
    const t = d.totals;
    $("model").textContent = d.server.model;
    $("updated").textContent = "updated " + new Date(d.now * 1000).toLocaleTimeString();
    $("requests").textContent = String(t.requests) + (t.errors ? " (" + t.errors + " failed)" : "");
    $("hit-rate").textContent = pct(t.hit_rate);
    $("cached-share").textContent = pct(t.cached_share);
    $("prompt-tokens").textContent = String(t.prompt_tokens);
    $("cached-tokens").textContent = String(t.cached_tokens);
    const ttft = median(d.recent.filter((r) => r.outcome === "ok").map((r) => r.ttft_ms));
    $("ttft-p50").textContent = ttft === null ? "–" : ttft.toFixed(1) + " ms";
    $("prepared").textContent = String(d.counters.turns_prepared || 0);
    const mem = d.server.memory, q = d.server.queue;
    $("memory").textContent = mem
      ? size(mem.budget_bytes) + (mem.capped ? " (capped)" : "") + " ≈ " + mem.conversations + " conversations of " + mem.n_ctx + " tokens"
      : "not sized";
    $("queue").textContent = q ? q.running_or_waiting + " / " + (q.max_queue + 1) + " (" + q.rejected + " refused)" : "–";
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
