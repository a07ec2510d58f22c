// The user's own numbers and the heatmap of a short run, in Chromium, as a person
// sees them. Runs made over HTTP as the Python client sends them:
// - two GAN-shaped runs whose `gf.step(metrics=...)` carry a reward, the
//   discriminator's accuracy and an episode's length (and `model_training`, which
//   the client adds for the detectors): the run page draws a panel for each of the
//   user's numbers and none for the client's; the comparison offers them and draws
//   one of them for both runs.
// - runs of a few hundred steps, every step reported or every fourth: each row of
//   the heatmap, where every module was measured, is one unbroken colour across the
//   page, with no lighter seam between columns (once read as "not measured").
//
// Run by tests/tests/e2e/dashboard.rs, which starts the server. Environment:
//   GRADFLOW_BASE       the server, e.g. http://127.0.0.1:41234
//   GRADFLOW_ARTIFACTS  folder for the screenshots
//   CHROMIUM            the browser (default /usr/bin/chromium)
import { mkdirSync } from "node:fs";
import { join } from "node:path";
import assert from "node:assert/strict";
import { checkLayoutOfCharts, closeAndReport, openDashboardBrowser } from "./dashboard_browser.mjs";

const base = process.env.GRADFLOW_BASE;
const artifacts = process.env.GRADFLOW_ARTIFACTS ?? "test-artifacts/dashboard";
assert.ok(base, "set GRADFLOW_BASE");
mkdirSync(artifacts, { recursive: true });

const { browser, page, chartPage, problems } = await openDashboardBrowser();
const step = (name) => console.log(`- ${name}`);
const shot = async (name) => {
  const path = join(artifacts, name);
  await page.screenshot({ path, fullPage: true });
  console.log(`screenshot ${path}`);
};
const call = async (path, body, method = "POST") => {
  const response = await fetch(base + path, {
    method,
    headers: { "Content-Type": "application/json" },
    body: JSON.stringify(body),
  });
  assert.ok(response.ok, `${path}: HTTP ${response.status} ${await response.text()}`);
};
const MODULES = ["gen.fc1", "gen.fc2", "gen.out", "disc.fc1", "disc.fc2", "disc.out"];

/** Registers `id` and sends a step for each of `steps`; `metrics(step)` gives its metrics. */
async function makeRun(id, steps, metrics) {
  await call(
    `/api/v1/runs/${id}`,
    {
      params: MODULES.map((module) => ({
        name: `${module}.weight`,
        module,
        group: module.split(".")[0],
        role: "linear",
        dtype: "f32",
        shape: [16, 16],
      })),
    },
    "PUT",
  );
  const records = steps.map((s) => ({
    step: s,
    loss: 1 + 0.1 * Math.cos(s / 5),
    // One gradient norm per module for the whole run, a decade apart: each row of
    // the heatmap is one colour, so anything else in it is drawn, not measured.
    modules: MODULES.map((module, i) => ({ module, grad_norm: 10 ** (i - 4), hook_hits: 1 })),
    metrics: metrics(s),
  }));
  for (let i = 0; i < records.length; i += 200) await call(`/api/v1/runs/${id}/steps`, records.slice(i, i + 200));
}

async function chartsLoaded() {
  await page.waitForFunction(() =>
    [...document.querySelectorAll("#charts img")].every((img) => img.complete && img.naturalWidth > 0),
  );
}

// Each chart's texts, as the browser lays them out.
async function chartTexts(src) {
  const response = await chartPage.goto(base + src);
  assert.ok(response.ok(), `${src}: HTTP ${response.status()}`);
  return chartPage.$$eval("text", (texts) => texts.map((t) => t.textContent.trim()).filter(Boolean));
}

// ---- The user's own numbers ----
const OWN = ["reward", "disc_accuracy", "episode_length"];
const ganMetrics = (shift) => (s) => ({
  reward: -1 + shift + s / 100,
  disc_accuracy: 0.5 + 0.1 * Math.sin(s / 9),
  episode_length: 200 + (s % 17),
  model_training: 1,
});
await makeRun("gan-a", [...Array(150).keys()], ganMetrics(0));
await makeRun("gan-b", [...Array(150).keys()], ganMetrics(0.5));

step("the run page draws a panel for each of the user's own metrics, and none for the client's");
await page.goto(`${base}/runs/gan-a`);
await chartsLoaded();
const metricsChart = page.locator("#chart-metrics");
assert.equal(await metricsChart.count(), 1, "the run page has no chart of the user's own metrics");
assert.ok((await metricsChart.boundingBox()).width > 1000, "the metrics chart spans the page");
await shot("run-gan-a.png");
const panels = await chartTexts(await metricsChart.getAttribute("src"));
for (const name of OWN) assert.ok(panels.includes(name), `no panel titled ${name}: ${panels}`);
assert.ok(!panels.includes("model_training"), `the client's own metric is drawn: ${panels}`);
const alt = await metricsChart.getAttribute("alt");
for (const name of OWN) assert.ok(alt.includes(name), `the alt text lacks ${name}: ${alt}`);
// The panels lay their text out clear (titles, ticks, no legend).
const [layout] = await checkLayoutOfCharts({ page, chartPage, base, artifacts }, "run-gan-a", ["chart-metrics"]);
assert.equal(layout.id, "chart-metrics");

step("a run without metrics of its own shows no such chart");
await makeRun("plain", [...Array(40).keys()], () => ({ model_training: 1 }));
await page.goto(`${base}/runs/plain`);
await chartsLoaded();
assert.equal(await page.locator("#chart-metrics").count(), 0, "a chart of metrics the user never sent");

step("the comparison offers the user's metrics and draws one for both runs");
await page.goto(`${base}/compare?run=gan-a&run=gan-b`);
await page.selectOption('select[name="metric"]', "metric");
const offered = await page.$$eval('select[name="subject"] optgroup[data-metric="metric"] option', (options) =>
  options.map((o) => o.value),
);
assert.deepEqual([...offered].sort(), [...OWN].sort(), "the comparison's own metrics");
await page.selectOption('select[name="subject"]', "disc_accuracy");
await Promise.all([page.waitForURL(/metric=metric/), page.getByRole("button", { name: "Compare", exact: true }).click()]);
assert.equal(new URL(page.url()).searchParams.get("subject"), "disc_accuracy");
assert.equal(await page.locator("#compare-missing").count(), 0, "both runs report disc_accuracy");
await chartsLoaded();
await shot("compare-own-metric.png");
const compareSrc = await page.getAttribute("#chart-compare", "src");
await checkLayoutOfCharts({ page, chartPage, base, artifacts }, "compare-own-metric");
const compared = await chartPage.evaluate(() => ({
  texts: [...document.querySelectorAll("text")].map((t) => t.textContent.trim()),
  lines: [...document.querySelectorAll("polyline")]
    .filter((l) => l.getAttribute("points").trim().split(/\s+/).length > 2)
    .map((l) => l.getAttribute("stroke")),
}));
assert.ok(compareSrc.includes("subject=disc_accuracy"), compareSrc);
assert.ok(compared.texts.some((t) => t.startsWith("disc_accuracy")), `title: ${compared.texts}`);
for (const id of ["gan-a", "gan-b"]) assert.ok(compared.texts.includes(id), `the legend lacks ${id}: ${compared.texts}`);
assert.equal(new Set(compared.lines).size, 2, `one line per run: ${compared.lines}`);

// ---- The heatmap of a short run ----
// The cells of the heatmap as drawn in the SVG: rectangles filled with a colour of
// the scale (not the page's white, the frame or the legend's gradient, which lies
// right of the cells).
async function cellRows(src) {
  const response = await chartPage.goto(base + src);
  assert.ok(response.ok(), `${src}: HTTP ${response.status()}`);
  return chartPage.evaluate(() => {
    const svg = document.documentElement;
    const rects = [...svg.querySelectorAll("rect")]
      .map((r) => ({
        x: Number(r.getAttribute("x")),
        y: Number(r.getAttribute("y")),
        width: Number(r.getAttribute("width")),
        height: Number(r.getAttribute("height")),
        fill: (r.getAttribute("fill") ?? "").toUpperCase(),
      }))
      .filter((r) => r.fill.startsWith("#") && r.fill !== "#FFFFFF" && r.width < 40 && r.height >= 4);
    // Rows: rectangles sharing a top edge, many of them.
    const rows = new Map();
    for (const r of rects) rows.set(r.y, [...(rows.get(r.y) ?? []), r]);
    const cells = [...rows.values()].filter((row) => row.length > 20);
    const rows_ = cells.map((row) => ({
      top: row[0].y,
      bottom: Math.min(...row.map((r) => r.y + r.height)),
      left: Math.min(...row.map((r) => r.x)),
      right: Math.max(...row.map((r) => r.x + r.width)),
    }));
    // The colour scale's legend below is drawn the same way, elsewhere: the rows of
    // cells are those spanning the plot, left of the first row.
    return { width: Number(svg.getAttribute("width")), rows: rows_.filter((r) => r.left === rows_[0].left) };
  });
}

// The pixels of `png` (a screenshot) as RGBA, read by the browser.
async function pixels(png) {
  return chartPage.evaluate(async (data) => {
    const image = new Image();
    image.src = `data:image/png;base64,${data}`;
    await image.decode();
    // The page holds an SVG document: a canvas of HTML.
    const canvas = document.createElementNS("http://www.w3.org/1999/xhtml", "canvas");
    [canvas.width, canvas.height] = [image.naturalWidth, image.naturalHeight];
    const context = canvas.getContext("2d");
    context.drawImage(image, 0, 0);
    return { width: canvas.width, data: [...context.getImageData(0, 0, canvas.width, canvas.height).data] };
  }, png.toString("base64"));
}

for (const [id, steps] of [
  ["short-dense", [...Array(300).keys()]],
  ["short-every-4th", [...Array(100).keys()].map((i) => 4 * i)],
  ["short-odd", [...Array(437).keys()]],
]) {
  step(`the heatmap of ${id} (${steps.length} steps) has no seam in a measured row`);
  await makeRun(id, steps, () => ({}));
  // The page's own width, and a narrower window, where the image is scaled down.
  for (const viewport of [1280, 1000]) {
    await page.setViewportSize({ width: viewport, height: 800 });
    await page.goto(`${base}/runs/${id}`);
    await chartsLoaded();
    const img = page.locator("#chart-grad-flow");
    const drawn = await cellRows(await img.getAttribute("src"));
    assert.equal(drawn.rows.length, MODULES.length, `${id}: a row of cells per module: ${JSON.stringify(drawn.rows)}`);
    // The image as the page shows it: scaled to its figure, as a browser draws it.
    const png = await img.screenshot({ path: join(artifacts, `run-${id}-${viewport}-chart-grad-flow.png`) });
    const shown = await pixels(png);
    const scale = shown.width / drawn.width;
    const seams = [];
    for (const row of drawn.rows) {
      // A line of pixels through the middle of the row, clear of its ends.
      const y = Math.round(((row.top + row.bottom) / 2) * scale);
      const [from, to] = [Math.ceil((row.left + 2) * scale), Math.floor((row.right - 2) * scale)];
      const at = (x) => shown.data.slice(4 * (y * shown.width + x), 4 * (y * shown.width + x) + 3);
      const colour = at(Math.round((from + to) / 2));
      for (let x = from; x <= to; x++) {
        const off = Math.max(...at(x).map((c, i) => Math.abs(c - colour[i])));
        if (off > 12) seams.push({ row: row.top, x, pixel: at(x), row_colour: colour });
      }
    }
    assert.deepEqual(
      seams.slice(0, 5),
      [],
      `${id}: ${seams.length} pixels of measured rows off their colour, shown ${shown.width}px wide`,
    );
  }
}
await page.setViewportSize({ width: 1280, height: 800 });

step("no console errors, failed requests or error responses");
await closeAndReport(browser, problems, "own numbers ok");
