// Drives Debian's headless Chromium through the dashboard of a running gradflow
// server, as a person would, and fails on anything a person would notice: a missing
// alert, a chart that does not load, a console error, a page that does not update.
// It also makes a multi-rank run of its own (synthetic ranks over HTTP) for the
// per-rank page.
//
// Run by tests/tests/dashboard.rs, which starts the server and the trainer first.
// Environment:
//   GRADFLOW_BASE       the server, e.g. http://127.0.0.1:41234
//   GRADFLOW_RUNS       comma-separated run ids to check; the first gets the live test
//   GRADFLOW_ARTIFACTS  folder for the screenshots
//   CHROMIUM            the browser (default /usr/bin/chromium)
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { makeHfRun } from "./hf_run.mjs";
import { checkLayoutOfCharts, closeAndReport, openDashboardBrowser } from "./dashboard_browser.mjs";

const base = process.env.GRADFLOW_BASE;
const runs = (process.env.GRADFLOW_RUNS ?? "").split(",").filter(Boolean);
const artifacts = process.env.GRADFLOW_ARTIFACTS ?? "test-artifacts/dashboard";
assert.ok(base && runs.length > 0, "set GRADFLOW_BASE and GRADFLOW_RUNS");
mkdirSync(artifacts, { recursive: true });

const { browser, page, chartPage, problems } = await openDashboardBrowser();

const api = async (path, init) => {
  const response = await fetch(base + path, init);
  const text = await response.text();
  assert.ok(response.ok, `${path}: HTTP ${response.status} ${text}`);
  return JSON.parse(text);
};
const shot = async (name) => {
  const path = join(artifacts, name);
  await page.screenshot({ path, fullPage: true });
  console.log(`screenshot ${path}`);
};
const step = (name) => console.log(`- ${name}`);

async function chartsLoaded(least = 3) {
  // Every chart image has loaded and shows something.
  await page.waitForFunction(() =>
    [...document.querySelectorAll("#charts img")].every((img) => img.complete && img.naturalWidth > 0),
  );
  const charts = await page.$$eval("#charts img", (imgs) =>
    imgs.map((img) => ({ id: img.id, width: img.naturalWidth, shown: img.getBoundingClientRect().width })),
  );
  assert.ok(charts.length >= least, `expected the charts, found ${JSON.stringify(charts)}`);
  for (const chart of charts) assert.ok(chart.width > 0 && chart.shown > 100, `chart not visible: ${JSON.stringify(chart)}`);
  return charts;
}

const checkChartLayout = (prefix) => checkLayoutOfCharts({ page, chartPage, base, artifacts }, prefix);

// ---- The runs page ----
step("the runs page lists every run, with its status and what is wrong");
await page.goto(`${base}/`);
for (const runId of runs) {
  const row = page.locator(`tr[data-run-id="${runId}"]`);
  await row.waitFor();
  const open = (await api(`/api/v1/runs/${runId}/alerts?status=open`)).alerts;
  assert.ok(open.length > 0, `run ${runId} should have open alerts`);
  const text = await row.innerText();
  for (const alert of open.slice(0, 3)) assert.ok(text.includes(alert.title), `row of ${runId} lacks "${alert.title}": ${text}`);
  assert.match(text, /critical/i);
  assert.match(text, /finished|live/);
}
// Critical runs are listed before healthy ones.
const order = await page.$$eval("tbody tr[data-run-id]", (rows) => rows.map((r) => r.dataset.runId));
assert.equal(order.length, (await api("/api/v1/runs")).runs.length);
await page.keyboard.press("Tab");
assert.equal(await page.evaluate(() => document.activeElement?.className), "skip-link", "the first Tab reaches the skip link");
await shot("runs.png");

// ---- Each run's page ----
const runCharts = [];
for (const runId of runs) {
  step(`the page of ${runId} shows its open alerts word for word, and its charts`);
  await page.goto(`${base}/runs/${runId}`);
  const open = (await api(`/api/v1/runs/${runId}/alerts?status=open`)).alerts;
  for (const alert of open) {
    const card = page.locator(`#alerts article[data-alert-id="${alert.id}"]`);
    await card.waitFor();
    assert.ok(await card.isVisible(), `alert ${alert.id} is not visible`);
    assert.equal(await card.locator(".alert-title").innerText(), alert.title);
    assert.equal(await card.locator(".alert-detail").innerText(), alert.detail);
    assert.equal(await card.locator(".alert-fix").innerText(), `Fix: ${alert.fix}`);
  }
  await chartsLoaded();
  await shot(`run-${runId}.png`);
  runCharts.push(...(await checkChartLayout(`run-${runId}`)));
}
// The frozen-norm run's drift chart shades its alert's episode, whose label must
// clear the legend: the case the layout check is for must have been checked.
assert.ok(
  runCharts.some((chart) => chart.episodes > 0 && chart.legends > 0),
  `no chart with a labelled episode and a legend was checked: ${JSON.stringify(runCharts)}`,
);

// ---- A Hugging Face-shaped model, in f32 and in bf16 ----
// Groups `model.embed_tokens`, `model.layers`, `model.norm`, `lm_head`, whose
// labels once covered the module labels; a constant lr, whose axis once read
// `0.001` five times; bf16 norm weights frozen at lr 1e-5, whose lr line once fell
// below the chart.
for (const dtype of ["f32", "bf16"]) {
  const id = `hf-${dtype}`;
  step(`an HF-shaped ${dtype} run: its charts laid out clear, each fix in place`);
  await makeHfRun(base, id, dtype);
  await page.goto(`${base}/runs/${id}`);
  await chartsLoaded();
  await shot(`run-${id}.png`);
  const layout = await checkChartLayout(`run-${id}`);
  const heatmap = layout.find((c) => c.id === "chart-grad-flow");
  assert.equal(heatmap.width, 1200, "the heatmap at the page's size");

  // Each chart's text and lines, as the browser lays them out.
  const read = async (chartId) => {
    await chartPage.goto(base + (await page.getAttribute(`#${chartId}`, "src")));
    return chartPage.evaluate(() => {
      const box = (el) => el.getBoundingClientRect();
      return {
        texts: [...document.querySelectorAll("text")].map((t) => ({ text: t.textContent.trim(), x: box(t).x, y: box(t).y + box(t).height / 2 })),
        lines: [...document.querySelectorAll("polyline")].map((l) => ({
          stroke: l.getAttribute("stroke"),
          points: l.getAttribute("points").trim().split(/\s+/).map((p) => p.split(",").map(Number)),
        })),
        legends: [...document.querySelectorAll("rect")].filter((r) => r.getAttribute("opacity") === "0.85").map(box),
      };
    });
  };
  const flow = await read("chart-grad-flow");
  for (const group of ["[model.embed_tokens]", "[model.layers]", "[model.norm]", "[lm_head]"]) {
    assert.ok(flow.texts.some((t) => t.text === group), `the heatmap names ${group}: ${flow.texts.map((t) => t.text)}`);
  }
  assert.ok(flow.texts.some((t) => t.text === "0.self_attn.q_proj"), "the heatmap names each module");

  const loss = await read("chart-loss");
  const lrTicks = loss.texts.filter((t) => t.x > 500 && /^[0-9.e-]+$/.test(t.text)).map((t) => t.text);
  assert.ok(lrTicks.length >= 3, `${id}: lr ticks ${lrTicks}`);
  assert.equal(new Set(lrTicks).size, lrTicks.length, `${id}: an lr tick label repeats: ${lrTicks}`);

  // The group norms' and norm weights' legends are under their plots: no point
  // of a plotted line lies under them.
  for (const chartId of ["chart-group-grad-norms", "chart-norm-drift"]) {
    const drawn = await read(chartId);
    assert.equal(drawn.legends.length, 1, `${id}: the legend of ${chartId}`);
    const [legend] = drawn.legends;
    for (const line of drawn.lines.filter((l) => l.points.length > 2)) {
      for (const [x, y] of line.points) {
        assert.ok(!(x >= legend.x && x <= legend.x + legend.width && y >= legend.y && y <= legend.y + legend.height), `${id} ${chartId}: a line point ${x},${y} under the legend`);
      }
    }
  }
  const norms = await read("chart-norm-drift");
  const caption = await page.locator("#chart-norm-drift + figcaption").innerText();
  if (dtype === "f32") {
    assert.ok(!caption.includes("dashed"), `an f32 run draws no dashed line, yet: ${caption}`);
    assert.ok(!norms.lines.some((l) => l.stroke === "#787878"), "no lr line in f32");
  } else {
    assert.match(caption, /black dashed line is the smallest change bf16/);
    assert.match(caption, /grey dashed line is one optimizer step/);
    // Both references inside the plot, the lr (grey) under the smallest change
    // (black) and above the floor ("0"), where the chart shows why the weights froze.
    const level = (stroke) => norms.lines.find((l) => l.stroke === stroke && l.points.length === 2 && l.points[1][0] - l.points[0][0] === 6)?.points[0][1];
    const floor = norms.texts.find((t) => t.text === "0" && t.x < 78)?.y;
    const [smallest, lr] = [level("#000000"), level("#787878")];
    assert.ok(smallest < lr && lr < floor, `${id}: smallest change at y ${smallest}, lr at ${lr}, floor at ${floor}`);
    // The four lines at 0 (drift and update of two groups) are drawn apart.
    const zeros = new Set(norms.lines.filter((l) => l.points.length > 2 && l.stroke !== "#000000").map((l) => l.points[0][1]));
    assert.ok(zeros.size >= 4, `${id}: lines at 0 on top of each other: ${[...zeros]}`);
  }
}

step("two runs ticked on the runs page open their comparison");
await page.goto(`${base}/`);
const [firstRun, secondRun] = runs;
for (const id of [firstRun, secondRun]) await page.locator(`tr[data-run-id="${id}"] input[name="run"]`).check();
await Promise.all([page.waitForURL(/\/compare\?/), page.getByRole("button", { name: "Compare selected runs" }).click()]);
assert.deepEqual(new URL(page.url()).searchParams.getAll("run").sort(), [firstRun, secondRun].sort());
for (const id of [firstRun, secondRun]) await page.locator(`#compared-runs tr[data-run-id="${id}"]`).waitFor();
await chartsLoaded(1);
await shot("compare-loss.png");
await checkChartLayout("compare-loss");

step("the comparison switches to a module's gradient norm, and shows both runs");
// A module both runs report: the first of the modules offered.
const module = await page.$eval('select[name="subject"] optgroup[label^="Modules"] option', (o) => o.value);
await page.selectOption('select[name="metric"]', "grad_norm");
await page.selectOption('select[name="subject"]', module);
await Promise.all([page.waitForURL(/metric=grad_norm/), page.getByRole("button", { name: "Compare", exact: true }).click()]);
const compared = new URL(page.url()).searchParams;
assert.equal(compared.get("subject"), module);
assert.equal(await page.inputValue('select[name="metric"]'), "grad_norm", "the form keeps the metric");
assert.equal(await page.locator("#compare-missing").count(), 0, `both runs report ${module}`);
await chartsLoaded(1);
await shot("compare-grad-norm.png");
const [gradNorm] = await checkChartLayout("compare-grad-norm");
assert.equal(gradNorm.id, "chart-compare");
// In the chart itself: a legend entry and a plotted line per run.
const drawn = await chartPage.evaluate(() => ({
  texts: [...document.querySelectorAll("text")].map((t) => t.textContent.trim()),
  lines: [...document.querySelectorAll("polyline")]
    .filter((l) => l.getAttribute("points").trim().split(/\s+/).length > 2)
    .map((l) => l.getAttribute("stroke")),
}));
for (const id of [firstRun, secondRun]) assert.ok(drawn.texts.includes(id), `the legend lacks ${id}: ${drawn.texts}`);
assert.ok(drawn.texts.some((t) => t.startsWith(`Gradient norm of ${module}`)), `title: ${drawn.texts}`);
assert.equal(new Set(drawn.lines).size, 2, `one line per run: ${drawn.lines}`);

step("runs ticked on the runs page stay ticked through a live update");
await page.goto(`${base}/`);
await page.locator("#live-indicator.connected").waitFor();
await page.locator(`tr[data-run-id="${secondRun}"] input[name="run"]`).check();
await page.evaluate(() => {
  window.gradflowRefreshed = false;
  document.addEventListener("gradflow:refreshed", () => {
    window.gradflowRefreshed = true;
  });
});
const tick = (await api(`/api/v1/runs/${secondRun}`)).last_step + 1;
await api(`/api/v1/runs/${secondRun}/steps`, {
  method: "POST",
  headers: { "Content-Type": "application/json" },
  body: JSON.stringify([{ step: tick, loss: 1.5 }]),
});
await page.waitForFunction(
  ([id, expected]) =>
    window.gradflowRefreshed &&
    document.querySelector(`tr[data-run-id="${id}"] td.num`)?.textContent.replace(/,/g, "").trim() === expected,
  [secondRun, String(tick)],
  { timeout: 15000 },
);
assert.ok(await page.locator(`tr[data-run-id="${secondRun}"] input[name="run"]`).isChecked(), "the tick was lost");

const runId = runs[0];
step("the module table sorts and filters");
await page.goto(`${base}/runs/${runId}`);
await page.locator("#module-filter").fill("agent");
const groups = await page.$$eval("#module-rows tr:not([hidden])", (rows) => rows.map((r) => r.dataset.group));
assert.ok(groups.length > 0 && groups.every((g) => g === "agent"), `filter left ${groups}`);
await page.locator("#module-filter").fill("");
await page.locator('th[data-sort="grad"] button').click();
const grads = await page.$$eval("#module-rows tr", (rows) => rows.map((r) => r.dataset.grad).filter((g) => g !== "").map(Number));
assert.ok(grads.length > 0, "some modules have a gradient norm");
for (let i = 1; i < grads.length; i++) assert.ok(grads[i - 1] >= grads[i], `not sorted descending: ${grads}`);
assert.equal(await page.getAttribute('th[data-sort="grad"]', "aria-sort"), "descending");

step("a step range is kept in the URL and applied to the charts");
const run = await api(`/api/v1/runs/${runId}`);
const from = run.first_step + 10;
const to = run.last_step - 10;
await page.locator('input[name="from_step"]').fill(String(from));
await page.locator('input[name="to_step"]').fill(String(to));
await Promise.all([page.waitForURL(/from_step=/), page.locator("form.range button").click()]);
const url = new URL(page.url());
assert.equal(url.searchParams.get("from_step"), String(from));
assert.equal(url.searchParams.get("to_step"), String(to));
const srcs = await page.$$eval("#charts img", (imgs) => imgs.map((img) => img.getAttribute("src")));
for (const src of srcs) assert.ok(src.includes(`from_step=${from}`) && src.includes(`to_step=${to}`), src);
await chartsLoaded();
await page.reload();
assert.equal(await page.inputValue('input[name="from_step"]'), String(from), "a reload keeps the range");

step("new steps and a new alert arrive live, without a reload");
await page.goto(`${base}/runs/${runId}`);
await chartsLoaded();
await page.locator("#live-indicator.connected").waitFor();
await page.evaluate(() => {
  window.gradflowNotReloaded = true;
});
const before = await page.locator("#last-step").innerText();
const gradFlowBefore = await page.getAttribute("#chart-grad-flow", "src");
const first = run.last_step + 1;
const records = [];
for (let s = first; s < first + 20; s++) {
  records.push({ step: s, loss: s === first + 19 ? "NaN" : 1.5, lr: 3e-4 });
}
await api(`/api/v1/runs/${runId}/steps`, {
  method: "POST",
  headers: { "Content-Type": "application/json" },
  body: JSON.stringify(records),
});
const last = first + 19;
await page.waitForFunction(
  (expected) => document.getElementById("last-step")?.textContent.replace(/,/g, "") === expected,
  String(last),
  { timeout: 15000 },
);
const [lossAlert] = (await api(`/api/v1/runs/${runId}/alerts?kind=loss_nonfinite&status=open`)).alerts;
assert.ok(lossAlert, "the NaN loss opened a loss_nonfinite alert");
const card = page.locator(`#alerts > ol article[data-alert-id="${lossAlert.id}"]`);
await card.waitFor({ timeout: 15000 });
assert.equal(await card.locator(".alert-title").innerText(), lossAlert.title);
await page.waitForFunction(
  (old) => document.getElementById("chart-grad-flow")?.getAttribute("src") !== old,
  gradFlowBefore,
  { timeout: 15000 },
);
assert.ok(await page.evaluate(() => window.gradflowNotReloaded === true), "the page was reloaded");
assert.notEqual(before, await page.locator("#last-step").innerText());
await chartsLoaded();
await shot(`run-${runId}-live.png`);
// Now with an episode open at the last step, its label at the right edge.
await checkChartLayout(`run-${runId}-live`);

// ---- A multi-rank run, rank by rank ----
step("a multi-rank run: its page links to its ranks, and the ranks page shows each rank");
// Four synthetic ranks over HTTP: rank 2 straggles (its own work takes 3.5× the
// others'), rank 3 lags twelve steps. shared.proj is replicated (the same norm on
// every rank), sharded.mlp sharded (each rank its own part).
const multi = "ranks-demo";
const world = 4;
for (let rank = 0; rank < world; rank++) {
  await api(`/api/v1/runs/${multi}`, {
    method: "PUT",
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify({
      name: "four ranks",
      world_size: world,
      rank,
      params: [
        { name: "shared.proj.weight", shape: [8, 8] },
        { name: "sharded.mlp.weight", shape: [16, 8], layout: "sharded" },
      ],
    }),
  });
}
const rankRecord = (s, rank) => ({
  step: s,
  rank,
  loss: 3 - s * 0.01,
  step_time: (rank === 2 ? 0.35 : 0.1) + 0.01 * ((s * 7 + rank) % 5),
  modules: [
    { module: "shared.proj", grad_norm: 0.5 + 0.1 * Math.sin(s / 5), hook_hits: 1, numel: 64 },
    { module: "sharded.mlp", grad_sumsq: (rank + 1) ** 2 * (1 + 0.2 * Math.cos(s / 7)), hook_hits: 1, numel: 128 / world },
  ],
});
const sendRanks = async (from, to, ranks) => {
  for (const rank of ranks) {
    const records = [];
    for (let s = from; s < to; s++) records.push(rankRecord(s, rank));
    await api(`/api/v1/runs/${multi}/steps`, {
      method: "POST",
      headers: { "Content-Type": "application/json" },
      body: JSON.stringify(records),
    });
  }
};
await sendRanks(0, 40, [0, 1, 2]);
await sendRanks(0, 28, [3]);
const [straggler] = (await api(`/api/v1/runs/${multi}/alerts?kind=rank_straggler&status=open`)).alerts;
assert.ok(straggler, "rank 2's step times opened a rank_straggler alert");
assert.equal(straggler.subject, "rank 2");

await page.goto(`${base}/runs/${multi}`);
await Promise.all([page.waitForURL(/\/runs\/ranks-demo\/ranks$/), page.locator("#ranks-link a").click()]);
const standing = await api(`/api/v1/runs/${multi}/ranks`);
const rows = await page.$$eval("#rank-rows tr", (trs) =>
  trs.map((tr) => ({
    rank: Number(tr.dataset.rank),
    attention: tr.classList.contains("attention"),
    cells: [...tr.querySelectorAll("td")].map((td) => td.innerText.trim()),
  })),
);
assert.equal(rows.length, world, `a row per rank: ${JSON.stringify(rows)}`);
for (const rank of standing.ranks) {
  const row = rows[rank.rank];
  assert.equal(row.rank, rank.rank);
  assert.equal(row.cells[1], String(rank.last_step), `rank ${rank.rank}'s last step`);
  assert.equal(row.cells[2], String(rank.behind), `rank ${rank.rank} behind`);
  assert.equal(row.cells[3], `${(rank.step_time * 1000).toFixed(1)} ms`, `rank ${rank.rank}'s step time`);
  assert.equal(row.attention, rank.open_alerts.length > 0, `rank ${rank.rank} stands out only with an alert`);
}
assert.equal(rows[3].cells[2], "12", "rank 3 lags twelve steps");
assert.ok(rows[2].cells[4].includes(straggler.title), `the straggler's row names its alert: ${rows[2].cells[4]}`);
const stragglerCard = page.locator(`#rank-alerts article[data-alert-id="${straggler.id}"]`);
assert.equal(await stragglerCard.locator(".alert-title").innerText(), straggler.title);
assert.equal(await stragglerCard.locator(".alert-detail").innerText(), straggler.detail);
assert.equal(await stragglerCard.locator(".alert-fix").innerText(), `Fix: ${straggler.fix}`);
const rankCharts = await chartsLoaded(2);
assert.deepEqual(rankCharts.map((c) => c.id), ["chart-ranks-step-time", "chart-ranks-grad-norm"]);
await shot("ranks.png");
const ranksLayout = await checkChartLayout("ranks");
// The step-time chart shades the straggler's episode beside its legend.
assert.ok(ranksLayout[0].episodes > 0 && ranksLayout[0].legends > 0, JSON.stringify(ranksLayout));
// A line per rank in each chart, and the straggler in its legend.
const stepTimes = await page.getAttribute("#chart-ranks-step-time", "src");
await chartPage.goto(base + stepTimes);
const strokes = () =>
  chartPage.evaluate(() => ({
    texts: [...document.querySelectorAll("text")].map((t) => t.textContent.trim()),
    lines: new Set(
      [...document.querySelectorAll("polyline")]
        .filter((l) => l.getAttribute("points").trim().split(/\s+/).length > 8)
        .map((l) => l.getAttribute("stroke")),
    ).size,
  }));
const stepDrawn = await strokes();
assert.equal(stepDrawn.lines, world, `one line per rank: ${JSON.stringify(stepDrawn)}`);
for (let rank = 0; rank < world; rank++) assert.ok(stepDrawn.texts.includes(`rank ${rank}`), `legend: ${stepDrawn.texts}`);
assert.ok(stepDrawn.texts.includes("rank_straggler: rank 2"), `the episode's label: ${stepDrawn.texts}`);

step("picking a module shows its gradient norm per rank");
assert.equal(await page.inputValue('#rank-module-form select[name="module"]'), "shared.proj", "the first module is shown");
const moduleBefore = await page.getAttribute("#chart-ranks-grad-norm", "src");
await page.selectOption('#rank-module-form select[name="module"]', "sharded.mlp");
await Promise.all([page.waitForURL(/module=sharded\.mlp/), page.locator("#rank-module-form button").click()]);
assert.equal(await page.inputValue('#rank-module-form select[name="module"]'), "sharded.mlp", "the form keeps the module");
const moduleAfter = await page.getAttribute("#chart-ranks-grad-norm", "src");
assert.notEqual(moduleAfter, moduleBefore);
assert.equal(new URL(base + moduleAfter).searchParams.get("subject"), "sharded.mlp");
await chartsLoaded(2);
await shot("ranks-module.png");
await checkChartLayout("ranks-module");
await chartPage.goto(base + moduleAfter);
const sharded = await strokes();
assert.ok(sharded.texts.some((t) => t.startsWith("Gradient norm of sharded.mlp per rank")), `title: ${sharded.texts}`);
assert.equal(sharded.lines, world, `each rank's own shard, a line each: ${JSON.stringify(sharded)}`);

step("the ranks page follows the ranks live, without a reload");
await page.locator("#live-indicator.connected").waitFor();
await page.evaluate(() => {
  window.gradflowNotReloaded = true;
});
// Rank 3 catches up part of the way: the steps it completes are combined.
await sendRanks(40, 60, [0, 1, 2]);
await sendRanks(28, 44, [3]);
await page.waitForFunction(
  () =>
    document.getElementById("front-step")?.textContent.replace(/,/g, "") === "59" &&
    document.getElementById("combined-step")?.textContent.replace(/,/g, "") === "43" &&
    document.querySelector('#rank-rows tr[data-rank="3"] td:nth-of-type(3)')?.textContent.trim() === "16",
  null,
  { timeout: 15000 },
);
await page.waitForFunction(
  (old) => document.getElementById("chart-ranks-step-time")?.getAttribute("src") !== old,
  stepTimes,
  { timeout: 15000 },
);
assert.ok(await page.evaluate(() => window.gradflowNotReloaded === true), "the page was reloaded");
assert.equal(await page.inputValue('#rank-module-form select[name="module"]'), "sharded.mlp", "the module chosen stays");
await chartsLoaded(2);
await shot("ranks-live.png");
await checkChartLayout("ranks-live");

step("the ranks page on a narrow screen");
await page.setViewportSize({ width: 760, height: 900 });
await page.reload();
await chartsLoaded(2);
const overflow = await page.evaluate(() => document.documentElement.scrollWidth - document.documentElement.clientWidth);
assert.ok(overflow <= 0, `the page scrolls sideways by ${overflow}px`);
await shot("ranks-narrow.png");
await page.setViewportSize({ width: 1280, height: 800 });

step("no console errors, failed requests or error responses");
await closeAndReport(browser, problems, "dashboard ok");
