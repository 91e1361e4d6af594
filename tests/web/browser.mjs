// What the browser tests share: a static server and headless Chromium with WebGPU.

import { createServer } from "node:http";
import { createReadStream, statSync } from "node:fs";
import { extname, join, normalize } from "node:path";
import { chromium } from "playwright-core";

const MIME = {
  ".html": "text/html", ".js": "text/javascript", ".css": "text/css", ".wasm": "application/wasm",
  ".json": "application/json", ".gguf": "application/octet-stream",
};

/**
 * A static file server for `root` on 127.0.0.1 and a free port; `requests`
 * counts each path; `routes` maps a path to its own handler `(req, res)`;
 * `headers` go with every file (e.g. COOP/COEP for cross-origin isolation).
 */
export function serve(root, requests = new Map(), routes = {}, headers = {}) {
  const server = createServer((req, res) => {
    const path = normalize(decodeURIComponent(new URL(req.url, "http://x").pathname));
    requests.set(path, (requests.get(path) ?? 0) + 1);
    if (routes[path]) {
      routes[path](req, res);
      return;
    }
    const file = join(root, path.endsWith("/") ? `${path}index.html` : path);
    let size;
    try {
      size = statSync(file).size;
    } catch {
      res.writeHead(404).end();
      return;
    }
    res.writeHead(200, {
      ...headers,
      "content-type": MIME[extname(file)] ?? "application/octet-stream",
      "content-length": size,
    });
    createReadStream(file).pipe(res);
  });
  return new Promise((resolve) => server.listen(0, "127.0.0.1", () => resolve(server)));
}

/** Chromium with WebGPU; a failed start (it happens on loaded machines) is retried twice. */
export async function launch(dir) {
  for (let attempt = 1; ; attempt++) {
    try {
      return await chromium.launchPersistentContext(dir, {
        executablePath: process.env.CHROMIUM ?? "/usr/bin/chromium",
        headless: true,
        timeout: 60_000,
        args: [
          "--enable-unsafe-webgpu", "--no-sandbox", "--headless", "--disable-background-networking",
          "--disable-component-update", "--disable-sync", "--disable-quic", "--no-first-run",
        ],
      });
    } catch (e) {
      if (attempt === 3) throw e;
      console.log(`chromium did not start (attempt ${attempt}): ${e.message}`);
    }
  }
}

