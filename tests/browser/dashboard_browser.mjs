// What every browser test of the dashboard shares: Chromium opened the same way,
// and the check that each chart of a page lays its text out clear.

import { join } from "node:path";
import assert from "node:assert/strict";
import { chromium } from "playwright-core";

// Chromium with a page for the dashboard and one for charts opened on their own (as
// SVG documents, to read their layout), and the problems a person would notice on
// the page: console errors and warnings, failed requests, error responses.
export async function openDashboardBrowser() {
  // The flags this machine's closed network needs (no background connections).
  const browser = await chromium.launch({
    executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
    args: [
      "--no-sandbox",
      "--disable-gpu",
      "--disable-quic",
      "--no-first-run",
      "--disable-background-networking",
      "--disable-component-update",
      "--disable-sync",
    ],
  });
  const context = await browser.newContext({ viewport: { width: 1280, height: 800 } });
  const page = await context.newPage();
  // Charts opened on their own, as SVG documents, to read their layout.
  const chartPage = await context.newPage();
  const problems = [];
  page.on("console", (message) => {
    if (message.type() === "error" || message.type() === "warning") {
      problems.push(`console ${message.type()}: ${message.text()}`);
    }
  });
  page.on("pageerror", (error) => problems.push(`page error: ${error.message}`));
  page.on("requestfailed", (request) => {
    // An event stream cut by a navigation is not a failure.
    if (!request.url().includes("/api/v1/events")) {
      problems.push(`request failed: ${request.url()} ${request.failure()?.errorText}`);
    }
  });
  page.on("response", (response) => {
    if (response.status() >= 400) problems.push(`HTTP ${response.status()}: ${response.url()}`);
  });
  return { browser, page, chartPage, problems };
}

// Closes the browser; fails with the problems seen, if any, else says `done`.
export async function closeAndReport(browser, problems, done) {
  await browser.close();
  if (problems.length > 0) {
    console.error(problems.join("\n"));
    process.exit(1);
  }
  console.log(done);
}

// Every chart of the page, fetched at the size the page asks for and opened as an
// SVG document, so the browser lays its text out: screenshot it, and fail when a
// text box (a legend entry, an alert episode's label, a tick, a title) covers
// another or leaves the chart. The episode labels once sat under the legend box.
const EPISODE_LABEL = "#D62728"; // charts::BAND, the alert episodes' colour
// `only`: the ids of the charts to check, when not all of them.
export async function checkLayoutOfCharts({ page, chartPage, base, artifacts }, prefix, only = null) {
  const charts = (
    await page.$$eval("#charts img", (imgs) => imgs.map((img) => ({ id: img.id, src: img.getAttribute("src") })))
  ).filter((chart) => only === null || only.includes(chart.id));
  assert.ok(charts.length > 0, `${prefix}: no charts`);
  const checked = [];
  for (const { id, src } of charts) {
    const response = await chartPage.goto(base + src);
    assert.ok(response.ok(), `${src}: HTTP ${response.status()}`);
    const layout = await chartPage.evaluate(() => {
      const svg = document.documentElement;
      // The box as drawn: after the rotation of a y-axis label, unlike getBBox().
      const box = (el) => {
        const b = el.getBoundingClientRect();
        return { x: b.x + window.scrollX, y: b.y + window.scrollY, width: b.width, height: b.height };
      };
      const texts = [...svg.querySelectorAll("text")]
        .filter((t) => t.textContent.trim() !== "")
        .map((t) => ({ text: t.textContent.trim(), fill: (t.getAttribute("fill") ?? "").toUpperCase(), box: box(t) }));
      // plotters draws the legend's background at 0.85 opacity; nothing else is.
      const legends = [...svg.querySelectorAll("rect")].filter((r) => r.getAttribute("opacity") === "0.85").map(box);
      return { width: Number(svg.getAttribute("width")), height: Number(svg.getAttribute("height")), texts, legends };
    });
    const asked = new URL(base + src).searchParams.get("width");
    assert.equal(String(layout.width), asked, `${src}: drawn ${layout.width} wide`);
    await chartPage.setViewportSize({ width: layout.width, height: layout.height });
    const path = join(artifacts, `${prefix}-${id}.png`);
    await chartPage.screenshot({ path });
    console.log(`screenshot ${path}`);

    // Boxes that share more than a pixel each way.
    const overlap = (a, b) =>
      Math.min(a.x + a.width, b.x + b.width) - Math.max(a.x, b.x) > 1 &&
      Math.min(a.y + a.height, b.y + b.height) - Math.max(a.y, b.y) > 1;
    const where = (t) => `"${t.text}" at ${Math.round(t.box.x)},${Math.round(t.box.y)} ${Math.round(t.box.width)}×${Math.round(t.box.height)}`;
    const { texts, legends } = layout;
    assert.ok(texts.length > 3, `${src}: no text in the chart`);
    for (const t of texts) {
      const b = t.box;
      assert.ok(
        b.x >= -1 && b.y >= -1 && b.x + b.width <= layout.width + 1 && b.y + b.height <= layout.height + 1,
        `${src}: ${where(t)} leaves the ${layout.width}×${layout.height} chart`,
      );
    }
    for (let i = 0; i < texts.length; i++) {
      for (let j = i + 1; j < texts.length; j++) {
        assert.ok(!overlap(texts[i].box, texts[j].box), `${src}: ${where(texts[i])} overlaps ${where(texts[j])}`);
      }
    }
    const episodes = texts.filter((t) => t.fill === EPISODE_LABEL);
    for (const label of episodes) {
      for (const legend of legends) {
        assert.ok(!overlap(label.box, legend), `${src}: episode label ${where(label)} is under the legend box`);
      }
    }
    checked.push({ id, width: layout.width, height: layout.height, texts: texts.length, episodes: episodes.length, legends: legends.length });
  }
  console.log(`  layout of ${prefix}: ${JSON.stringify(checked)}`);
  return checked;
}

