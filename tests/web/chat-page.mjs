// Driving the chat page (web/www) as a user does: pick a model and a backend,
// load, type a message and press Enter, stop; read back what the page shows.

const TIMEOUT_MS = 3 * 60 * 1000;

/** Opens the settings panel (once) so its fields can be filled. */
export async function openSettings(page) {
  if (!(await page.$eval("#settings-panel", (d) => d.open))) await page.click("#settings-panel summary");
}

/** Picks `backend` ("auto", "webgpu", "cpu"): with a model loaded, this reloads it. */
export async function chooseBackend(page, backend) {
  await page.selectOption("#backend", backend);
}

/** Picks a served model (its URL) in the model picker, clicks Load; returns the final status. */
export async function loadServed(page, modelUrl, { cache = true } = {}) {
  await openSettings(page);
  await page.setChecked("#no-cache", !cache);
  await page.selectOption("#model", modelUrl);
  await page.click("#load");
  return loadEnded(page);
}

/** Waits for the load under way to end; returns the status. */
export async function loadEnded(page) {
  await page.waitForFunction(
    () => /^(Ready|Loading failed)/.test(document.getElementById("status").textContent),
    null, { timeout: TIMEOUT_MS },
  );
  return page.textContent("#status");
}

/**
 * Types `text` into the composer and presses Enter, with the settings given
 * (greedy by default); returns once the reply has started (`started`: its
 * first piece shown) or ended.
 */
export async function send(page, text, { maxTokens = 8, template = true, temperature = 0, started = false } = {}) {
  await openSettings(page);
  await page.fill("#max-tokens", String(maxTokens));
  await page.fill("#temperature", String(temperature));
  await page.setChecked("#chat-template", template);
  const replies = await page.locator(".message.assistant").count();
  await page.fill("#prompt", text);
  await page.press("#prompt", "Enter");
  if (started) {
    await page.waitForFunction(
      (n) => document.querySelectorAll(".message.assistant")[n]?.querySelector(".bubble").textContent.length > 0,
      replies, { timeout: TIMEOUT_MS },
    );
  } else {
    await replyEnded(page);
  }
}

/** Waits for the running reply to end; returns the status. */
export async function replyEnded(page) {
  await page.waitForFunction(
    () => /^(Done|Stopped|Generation failed)/.test(document.getElementById("status").textContent),
    null, { timeout: TIMEOUT_MS },
  );
  return page.textContent("#status");
}

/** The latest reply: { text, ids, finish, meta }. */
export async function lastReply(page) {
  return page.$$eval(".message.assistant", (replies) => {
    const reply = replies.at(-1);
    return {
      text: reply?.querySelector(".bubble").textContent ?? null,
      ids: (reply?.dataset.tokens ?? "").split(" ").filter(Boolean).map(Number),
      finish: reply?.dataset.finish ?? null,
      meta: reply?.querySelector(".meta").textContent ?? null,
    };
  });
}

/** The bubbles, in order: [{ role, text }]. */
export async function conversation(page) {
  return page.$$eval(".message", (messages) => messages.map((m) => ({
    role: m.classList.contains("user") ? "user" : "assistant",
    text: m.querySelector(".bubble").textContent,
  })));
}
