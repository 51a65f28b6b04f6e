// The fleet page: polls /api/fleet (same origin, same login) and redraws without a reload.
"use strict";
(function () {
  const POLL_MS = 5000;
  const rank = { offline: 0, stale: 1, disk_low: 2, behind: 3, online: 4 };
  const $ = (id) => document.getElementById(id);
  let fleet = null;
  let selected = null;
  let sortKey = "state";

  function esc(s) {
    return String(s == null ? "" : s).replace(/[&<>"']/g, (c) =>
      ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" })[c]);
  }
  function age(seconds) {
    if (seconds == null || !isFinite(seconds)) return "-";
    const s = Math.max(0, Math.floor(seconds));
    if (s < 120) return s + "s";
    if (s < 7200) return Math.floor(s / 60) + "m";
    if (s < 172800) return Math.floor(s / 3600) + "h";
    return Math.floor(s / 86400) + "d";
  }
  function size(n) {
    if (n == null) return "-";
    const units = ["B", "KiB", "MiB", "GiB", "TiB"];
    let v = n, i = 0;
    while (v >= 1024 && i < units.length - 1) { v /= 1024; i++; }
    return (i ? v.toFixed(1) : v.toFixed(0)) + units[i];
  }
  function since(iso) { return iso ? (Date.now() - Date.parse(iso)) / 1000 : null; }

  function plot(svg, values) {
    if (!values.length) { svg.innerHTML = ""; return; }
    const max = Math.max(1, ...values);
    const n = values.length;
    const pts = values.map((v, i) => (n === 1 ? 0 : (i * 600) / (n - 1)).toFixed(1) + "," +
      (78 - (v / max) * 74).toFixed(1)).join(" ");
    svg.innerHTML = '<polyline points="' + pts + '"></polyline><text x="4" y="12" font-size="11">max ' +
      esc(max.toLocaleString()) + "</text>";
  }

  function compare(a, b) {
    if (sortKey === "lag") return (b.lag_records || 0) - (a.lag_records || 0);
    if (sortKey === "last_seen") return Date.parse(b.last_seen || 0) - Date.parse(a.last_seen || 0);
    if (sortKey === "device_id") return a.device_id < b.device_id ? -1 : a.device_id > b.device_id ? 1 : 0;
    return (rank[a.state] - rank[b.state]) || (a.device_id < b.device_id ? -1 : 1);
  }

  function render() {
    if (!fleet) return;
    const started = performance.now();
    const want = $("state").value;
    const q = $("search").value.trim().toLowerCase();
    const rows = fleet.devices.filter((d) => (!want || d.state === want) &&
      (!q || d.device_id.toLowerCase().includes(q)));
    rows.sort(compare);
    const html = new Array(rows.length);
    for (let i = 0; i < rows.length; i++) {
      const d = rows[i];
      html[i] = '<tr data-device="' + esc(d.device_id) + '" class="' + (d.connected ? "" : "offline") + '">' +
        "<td>" + esc(d.device_id) + '</td><td class="state state-' + esc(d.state) + '">' + esc(d.state) +
        "</td><td>" + age(since(d.last_seen)) + ' ago</td><td class="num">' +
        (d.lag_records == null ? "-" : d.lag_records.toLocaleString()) + '</td><td class="num wide">' +
        age(d.oldest_unacked_age_s) + '</td><td class="num wide">' + size(d.disk_free_bytes) +
        '</td><td class="wide">' + esc(d.remote || "-") + '</td><td class="wide">' + esc(d.agent_version || "-") +
        "</td></tr>";
    }
    $("rows").innerHTML = html.join("");
    $("shown").textContent = rows.length + " of " + fleet.devices.length + " devices shown";
    const c = fleet.counts;
    $("counts").innerHTML = ["online", "behind", "disk_low", "stale", "offline"].map((s) =>
      '<span class="state-' + s + '">' + c[s] + " " + s.replace("_", " ") + "</span>").join("");
    $("collector").textContent = fleet.collector_id ? "· " + fleet.collector_id : "";
    $("updated").textContent = "updated " + new Date(fleet.generated_at).toLocaleTimeString();
    document.body.dataset.devices = String(fleet.devices.length);
    document.body.dataset.renderMs = (performance.now() - started).toFixed(1);
  }

  async function refresh() {
    try {
      const r = await fetch("/api/fleet", { cache: "no-store" });
      if (!r.ok) throw new Error("HTTP " + r.status);
      fleet = await r.json();
      render();
      plot($("rate-plot"), (fleet.landing_rate || []).map((p) => p.rows_per_s));
      if (selected) await showDetail(selected);
    } catch (e) {
      $("updated").textContent = "update failed: " + e.message + " (retrying)";
    }
  }

  async function showDetail(device) {
    selected = device;
    const r = await fetch("/api/fleet/" + encodeURIComponent(device), { cache: "no-store" });
    if (!r.ok) { $("detail").hidden = true; return; }
    const d = await r.json();
    $("detail").hidden = false;
    history.replaceState(null, "", "#device=" + encodeURIComponent(device));
    $("detail-title").textContent = d.device_id + " — " + d.state + (d.connected ? "" : " (last known state)") +
      " — export lag over time";
    plot($("detail-plot"), (d.history || []).map((p) => p.lag_records));
    const ev = (d.events || []).slice(-5).reverse().map((e) => esc(e.t) + " " + esc(e.event) + " " +
      esc(e.detail)).join("<br>");
    const ex = (d.exports || []).map((e) => esc(e.name) + ": " + esc(e.state) + ", lag " + esc(e.lag_records) +
      ", oldest " + age(e.oldest_unacked_age_s)).join("<br>");
    $("detail-body").innerHTML = "<dl><dt>remote</dt><dd>" + esc(d.remote || "-") + "</dd><dt>first seen</dt><dd>" +
      esc(d.first_seen) + "</dd><dt>last report</dt><dd>" + esc(d.last_report || "-") + "</dd><dt>exports</dt><dd>" +
      (ex || "-") + "</dd><dt>records</dt><dd>" + esc(d.records_received) + " received, " + esc(d.records_landed) +
      " landed</dd><dt>events</dt><dd>" + (ev || "-") + "</dd></dl>";
  }

  $("state").addEventListener("change", render);
  $("search").addEventListener("input", render);
  $("sort").addEventListener("change", () => { sortKey = $("sort").value; render(); });
  document.querySelectorAll("th[data-sort]").forEach((th) => th.addEventListener("click", () => {
    sortKey = th.dataset.sort; $("sort").value = sortKey; render();
  }));
  $("rows").addEventListener("click", (e) => {
    const tr = e.target.closest("tr");
    if (tr) showDetail(tr.dataset.device);
  });
  // /fleet#device=ID opens that device's details (a link a person can share).
  const linked = /^#device=(.+)$/.exec(location.hash);
  if (linked) selected = decodeURIComponent(linked[1]);
  refresh();
  setInterval(refresh, POLL_MS);
})();
