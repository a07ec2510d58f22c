// gradflow dashboard: live updates (the runs page, a run's page, its ranks' page),
// module table sorting and filtering, the comparison form's subjects.
//
// The pages are complete without this script. With it, the page listens to the
// server's event stream (GET /api/v1/events) and, when a step or an alert arrives,
// fetches the same page again and swaps in the parts that changed. The server stays
// the only place that renders anything, so the live page says exactly what a reload
// would. No framework: the whole job is a few DOM swaps.
"use strict";

(() => {
  const body = document.body;
  const page = body.dataset.page;
  const runId = body.dataset.runId;
  const indicator = document.getElementById("live-indicator");

  // Parts of each page that live updates replace, by id.
  const LIVE_PARTS = {
    runs: ["runs-summary", "compare-hint", "runs-table"],
    run: ["run-meta", "alerts", "range-hint", "modules-heading", "modules-step", "module-rows", "charts"],
    ranks: ["rank-meta", "rank-alerts", "ranks-note", "rank-rows", "charts"],
  };
  // At most one re-fetch per this many milliseconds, however fast steps arrive.
  const MIN_REFRESH_MS = 1500;
  // The runs page also refreshes on a timer: "live" turns "stale" with no event.
  const RUNS_PAGE_POLL_MS = 30000;
  // So does the ranks page: a rank's records announce nothing until their step is
  // combined, so a rank running ahead of a lagging one shows only on a refresh.
  const RANKS_PAGE_POLL_MS = 10000;

  function setIndicator(connected) {
    if (!indicator) return;
    indicator.classList.toggle("connected", connected);
    indicator.classList.toggle("disconnected", !connected);
    indicator.textContent = connected ? "Live" : "Reconnecting…";
  }

  // Replaces a chart image only once its new version has loaded, so it never blinks.
  function swapImage(current, fresh) {
    const src = fresh.getAttribute("src");
    if (current.getAttribute("src") === src) return;
    const loaded = new Image();
    for (const attribute of fresh.attributes) {
      // A lazy image outside the document would never load.
      if (attribute.name !== "loading") loaded.setAttribute(attribute.name, attribute.value);
    }
    loaded.addEventListener("load", () => {
      if (current.isConnected) current.replaceWith(loaded);
    });
  }

  function swapCharts(current, fresh) {
    // The set of charts changes rarely (a loss scaler's first step); then swap it all.
    const ids = (el) => [...el.querySelectorAll("img[id]")].map((img) => img.id).join();
    if (ids(current) !== ids(fresh)) {
      current.replaceWith(document.importNode(fresh, true));
      return;
    }
    for (const img of fresh.querySelectorAll("img[id]")) {
      const mine = document.getElementById(img.id);
      if (mine) swapImage(mine, img);
    }
    for (const link of current.querySelectorAll("a.chart-link")) {
      const img = link.parentElement.querySelector("img");
      const freshImg = img && fresh.querySelector(`#${img.id}`);
      if (freshImg) link.href = freshImg.getAttribute("src").replace(".svg?", ".png?");
    }
  }

  function swapPart(id, fresh) {
    const current = document.getElementById(id);
    if (!current || !fresh) return;
    if (id === "charts") swapCharts(current, fresh);
    else if (current.outerHTML !== fresh.outerHTML) {
      // Runs ticked for a comparison stay ticked: a refresh must not undo a choice.
      const key = (box) => `${box.name}=${box.value}`;
      const ticked = new Set([...current.querySelectorAll("input[type=checkbox]:checked")].map(key));
      const node = document.importNode(fresh, true);
      for (const box of node.querySelectorAll("input[type=checkbox]")) {
        if (ticked.has(key(box))) box.checked = true;
      }
      current.replaceWith(node);
    }
  }

  // Coalesces bursts of events into at most one re-fetch per MIN_REFRESH_MS.
  function makeRefresher(ids, afterSwap) {
    let timer = null;
    let running = false;
    let again = false;
    let last = 0;
    async function refresh() {
      running = true;
      try {
        const response = await fetch(window.location.href, {
          headers: { Accept: "text/html" },
          cache: "no-store",
        });
        if (!response.ok) return;
        const doc = new DOMParser().parseFromString(await response.text(), "text/html");
        for (const id of ids) swapPart(id, doc.getElementById(id));
        afterSwap();
        document.dispatchEvent(new CustomEvent("gradflow:refreshed"));
      } catch (error) {
        setIndicator(false);
      } finally {
        running = false;
        last = Date.now();
        if (again) {
          again = false;
          schedule();
        }
      }
    }
    function schedule() {
      if (running) {
        again = true;
        return;
      }
      if (timer !== null) return;
      const wait = Math.max(0, last + MIN_REFRESH_MS - Date.now());
      timer = setTimeout(() => {
        timer = null;
        refresh();
      }, wait);
    }
    return schedule;
  }

  function listen(schedule) {
    if (!window.EventSource) return;
    const url = runId ? `/api/v1/events?run_id=${encodeURIComponent(runId)}` : "/api/v1/events";
    const source = new EventSource(url);
    source.addEventListener("open", () => setIndicator(true));
    source.addEventListener("error", () => setIndicator(false));
    for (const name of ["step", "alert", "lagged"]) source.addEventListener(name, schedule);
    window.addEventListener("pagehide", () => source.close());
  }

  // ---- The module table: sort by any column, filter by text. ----

  function setUpModuleTable() {
    const table = document.getElementById("module-table");
    if (!table) return () => {};
    const tools = document.querySelector(".table-tools");
    const filter = document.getElementById("module-filter");
    const count = document.getElementById("module-count");
    if (tools) tools.hidden = false;
    let sortKey = "order";
    let descending = false;

    const numeric = new Set(["order", "params", "grad", "hits"]);
    function value(row, key) {
      const raw = row.dataset[key] ?? "";
      if (!numeric.has(key)) return raw.toLowerCase();
      if (raw === "") return null;
      if (raw === "NaN") return Infinity; // NaN sorts with the largest: it is a problem.
      return Number(raw);
    }

    function apply() {
      const rows = document.getElementById("module-rows");
      if (!rows) return;
      const all = [...rows.rows];
      all.sort((a, b) => {
        const x = value(a, sortKey);
        const y = value(b, sortKey);
        if (x === null && y === null) return 0;
        if (x === null) return 1; // unmeasured last, either direction
        if (y === null) return -1;
        const order = x < y ? -1 : x > y ? 1 : 0;
        return descending ? -order : order;
      });
      for (const row of all) rows.appendChild(row);
      const needle = filter ? filter.value.trim().toLowerCase() : "";
      let shown = 0;
      for (const row of all) {
        const text = [row.dataset.module, row.dataset.group, row.dataset.role, row.dataset.dtype]
          .join(" ")
          .toLowerCase();
        row.hidden = needle !== "" && !text.includes(needle);
        if (!row.hidden) shown += 1;
      }
      if (count) count.textContent = `Showing ${shown} of ${all.length} modules`;
      for (const th of table.querySelectorAll("th[data-sort]")) {
        const active = th.dataset.sort === sortKey && sortKey !== "order";
        th.setAttribute("aria-sort", active ? (descending ? "descending" : "ascending") : "none");
      }
    }

    for (const th of table.querySelectorAll("th[data-sort]")) {
      th.querySelector("button").addEventListener("click", () => {
        const key = th.dataset.sort;
        if (key === sortKey) descending = !descending;
        else {
          sortKey = key;
          // Largest gradients and hook counts first is what a person looks for.
          descending = key === "grad" || key === "hits" || key === "params";
        }
        apply();
      });
    }
    if (filter) filter.addEventListener("input", apply);
    apply();
    return apply;
  }

  // ---- The comparison form: only the chosen metric's subjects are offered. ----

  function setUpCompareForm() {
    const form = document.getElementById("compare-form");
    const metric = form?.querySelector('select[name="metric"]');
    const subject = form?.querySelector('select[name="subject"]');
    if (!metric || !subject) return;
    function apply() {
      // The loss has no subject: leave the last one chosen as it is.
      if (metric.value === "loss") return;
      for (const group of subject.querySelectorAll("optgroup")) group.disabled = group.dataset.metric !== metric.value;
      const chosen = subject.selectedOptions[0];
      if (!chosen || chosen.parentElement.disabled) {
        const first = subject.querySelector(`optgroup[data-metric="${metric.value}"] option`);
        if (first) subject.value = first.value;
      }
    }
    metric.addEventListener("change", apply);
    apply();
  }

  if (page === "compare") setUpCompareForm();
  if (page === "run") {
    const reapplyTable = setUpModuleTable();
    listen(makeRefresher(LIVE_PARTS.run, reapplyTable));
  } else if (page === "ranks") {
    // The module form is not swapped: a choice being made stays.
    const schedule = makeRefresher(LIVE_PARTS.ranks, () => {});
    listen(schedule);
    setInterval(schedule, RANKS_PAGE_POLL_MS);
  } else if (page === "runs") {
    const schedule = makeRefresher(LIVE_PARTS.runs, () => {});
    listen(schedule);
    setInterval(schedule, RUNS_PAGE_POLL_MS);
  }
})();
