// Opens a profile in the real speedscope app (npm's `speedscope` package, served from
// localhost) in headless Chromium, driven by puppeteer-core, and reports what it rendered.
//
//   node check.js RELEASE_DIR PROFILE.json SCREENSHOT.png [CHROMIUM]
//
// Prints one JSON object: the page title, the text of the default view ("Time Order"), the
// text of the sandwich view (a DOM table of every function, which the flame charts, drawn on
// a canvas, do not have), and any errors the page reported. Takes a screenshot of the
// default view. Exits non-zero when the app could not load the profile.
"use strict";

const http = require("http");
const fs = require("fs");
const path = require("path");
const puppeteer = require("puppeteer-core");

const [releaseDir, profilePath, screenshotPath, chromium = "/usr/bin/chromium"] = process.argv.slice(2);
const types = { ".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".json": "application/json",
                ".wasm": "application/wasm", ".png": "image/png", ".woff2": "font/woff2", ".ico": "image/x-icon" };

function serve() {
  const server = http.createServer((req, res) => {
    const url = decodeURIComponent(req.url.split("?")[0].split("#")[0]);
    const file = url === "/profile.json" ? profilePath : path.join(releaseDir, path.normalize(url));
    fs.readFile(file, (err, data) => {
      if (err) { res.writeHead(404); res.end(); return; }
      res.writeHead(200, { "Content-Type": types[path.extname(file)] || "application/octet-stream" });
      res.end(data);
    });
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

async function main() {
  const server = await serve();
  const base = `http://127.0.0.1:${server.address().port}`;
  const browser = await puppeteer.launch({
    executablePath: chromium,
    headless: true,
    args: ["--no-sandbox", "--use-angle=swiftshader", "--enable-unsafe-swiftshader", "--window-size=1400,800"],
    defaultViewport: { width: 1400, height: 800 },
  });
  const errors = [];
  try {
    const page = await browser.newPage();
    page.on("pageerror", (e) => errors.push(String(e)));
    page.on("console", (m) => { if (m.type() === "error") errors.push(m.text()); });
    await page.goto(`${base}/index.html#profileURL=${encodeURIComponent(base + "/profile.json")}`,
                    { waitUntil: "networkidle0" });
    // The app names the loaded profile in the toolbar and the page title once it has drawn.
    await page.waitForFunction(() => document.title.includes("rbspy_ext"), { timeout: 15000 });
    await new Promise((r) => setTimeout(r, 500));
    await page.screenshot({ path: screenshotPath });
    const timeOrder = await page.evaluate(() => document.body.innerText);
    await page.keyboard.press("3"); // the sandwich view
    await new Promise((r) => setTimeout(r, 500));
    const sandwich = await page.evaluate(() => document.body.innerText);
    process.stdout.write(JSON.stringify({ title: await page.title(), timeOrder, sandwich, errors }));
  } finally {
    await browser.close();
    server.close();
  }
}

main().catch((e) => { console.error(String(e && e.stack || e)); process.exit(1); });
