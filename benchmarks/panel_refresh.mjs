#!/usr/bin/env node
/**
 * Browser CPU cost of one refresh of the jupyter-gpushare panel with 8 GPUs and 50 kernels.
 *
 * Starts JupyterLab (the jupyter-gpushare lab extension must be installed), serves a synthetic
 * 8-GPU / 50-kernel node to the page at the REST boundary (page.route: 50 real kernels do not
 * fit a CI machine), then drives N refreshes twice in the same page:
 *   baseline: the panel closed (the status bar's status poll only),
 *   panel:    the panel open (status + history fetch, 8 charts, 50 rows).
 * For each phase it reads Chromium's Performance.getMetrics over CDP before and after and
 * prints TaskDuration / ScriptDuration / Layout / RecalcStyle per refresh; the phases alternate
 * for --rounds rounds and the medians and their difference (the panel's cost) are reported.
 *
 * Usage: node benchmarks/panel_refresh.mjs [--refreshes 30] [--rounds 3] [--gpus 8] [--kernels 50]
 *        [--history-seconds 600] [--interval 1] [--port 8897] [--json out.json] [--profile]
 *        [--smoke]  (2 refreshes, 1 round, 2 GPUs, 5 kernels: the whole path, no figures)
 * The status bodies are built on the REST contract: every field comes from a body that
 * jupyter_gpushare.server.contract_bodies builds (python3), so a field the contract makes
 * required later is there too.
 * Needs: the npm deps of tests/ui-tests (jlpm install there), Chromium at /usr/bin/chromium
 * (or CHROMIUM_PATH).
 */
import { execFileSync, spawn } from 'node:child_process';
import { mkdtempSync, writeFileSync, rmSync } from 'node:fs';
import { createRequire } from 'node:module';
import { tmpdir } from 'node:os';
import { dirname, join, resolve } from 'node:path';
import { fileURLToPath } from 'node:url';

const here = dirname(fileURLToPath(import.meta.url));
const require = createRequire(resolve(here, '..', 'tests', 'ui-tests', 'package.json'));
const { chromium } = require('@playwright/test');

function arg(name, fallback) {
  const i = process.argv.indexOf(`--${name}`);
  return i > 0 ? process.argv[i + 1] : fallback;
}
const SMOKE = process.argv.includes('--smoke');
const REFRESHES = Number(arg('refreshes', SMOKE ? 2 : 30));
const ROUNDS = Number(arg('rounds', SMOKE ? 1 : 3));
const GPUS = Number(arg('gpus', SMOKE ? 2 : 8));
const KERNELS = Number(arg('kernels', SMOKE ? 5 : 50));
const HISTORY_SECONDS = Number(arg('history-seconds', 600));
const INTERVAL = Number(arg('interval', 1));
const PORT = Number(arg('port', 8897));
const JSON_OUT = arg('json', null);
const PROFILE = process.argv.includes('--profile');
const GiB = 1024 ** 3;

/** Contract-valid bodies with every required field at its neutral value, from the contract. */
const TEMPLATE = JSON.parse(
  execFileSync(process.env.PYTHON || 'python3', [
    '-c',
    'import json; from jupyter_gpushare.server import contract_bodies as b; ' +
      'print(json.dumps({"status": b.status(), "kernel": b.kernel(id="k"), "gpu": b.gpu()}))'
  ]).toString()
);

/** Deterministic pseudo-random numbers so runs are comparable. */
function rng(seed) {
  let s = seed >>> 0;
  return () => (s = (s * 1664525 + 1013904223) >>> 0) / 2 ** 32;
}

const STATES = ['active', 'idle', 'idle', 'released', 'active'];
const kernelIds = Array.from(
  { length: KERNELS },
  (_, i) => `${String(i).padStart(8, '0')}-0000-4000-8000-000000000000`
);

function makeStatus(seq) {
  const r = rng(seq + 1);
  const kernels = kernelIds.map((id, i) => {
    const state = STATES[i % STATES.length];
    const released = state === 'released';
    const bytes = released ? 0 : Math.round((0.5 + r() * 6) * GiB);
    return {
      ...TEMPLATE.kernel,
      id,
      name: 'python3',
      path: `project-${i % 7}/notebook-${i}.ipynb`,
      pids: [10000 + i],
      state,
      pinned: i % 11 === 0,
      gpu_memory_bytes: bytes,
      released_bytes: released ? 4 * GiB : 0,
      gpus: [i % GPUS],
      gpu_bytes: released ? {} : { [i % GPUS]: bytes },
      sm_utilization: state === 'active' ? Math.round(r() * 100) : 0,
      idle_seconds: (seq * INTERVAL + i * 7) % 900,
      release_in_seconds: released ? null : 600 - ((seq + i) % 600),
      method: 'simulated',
      releases: i % 3,
      restores: i % 2,
      last_restore_seconds: i % 2 ? 0.8 : null,
      error: null,
      waiting: null
    };
  });
  for (const k of kernels) {
    k.gpu_utilization = Object.fromEntries(
      Object.keys(k.gpu_bytes).map(g => [g, k.sm_utilization])
    );
  }
  const gpus = Array.from({ length: GPUS }, (_, g) => {
    const used = kernels.filter(k => k.gpus[0] === g).reduce((a, k) => a + k.gpu_memory_bytes, 0);
    return {
      ...TEMPLATE.gpu,
      index: g,
      uuid: `GPU-${g}`,
      name: 'Synthetic H100 80GB',
      memory_total: 80 * GiB,
      memory_used: used,
      utilization: Math.round(r() * 100),
      released_bytes: 4 * GiB
    };
  });
  return {
    ...TEMPLATE.status,
    backend: 'nvml',
    method: 'driver',
    available: true,
    reason: '',
    idle_timeout: 600,
    gpus,
    kernels
  };
}

/** The last `seconds` of a synthetic history ending at refresh `seq`, as the server answers. */
function makeHistory(seq, seconds) {
  const n = Math.max(1, Math.floor(Math.min(seconds, HISTORY_SECONDS) / INTERVAL));
  const now = 1.8e9 + seq * INTERVAL;
  const t = Array.from({ length: n }, (_, i) => +(now - (n - 1 - i) * INTERVAL).toFixed(3));
  const first = seq - (n - 1); // sample number of t[0], so patterns line up between answers
  const kernels = {};
  kernelIds.forEach((id, i) => {
    const bytes = t.map((_, j) => ((first + j + i) % 97 < 80 ? Math.round((1 + (i % 5)) * GiB) : 0));
    // Short bursts of work between long idle stretches, as in a notebook.
    const util = t.map((_, j) => ((first + j + i * 13) % 60 < 6 ? 40 + ((i * 17) % 60) : 0));
    kernels[id] = {
      t,
      gpu_memory_bytes: bytes,
      sm_utilization: util,
      gpu: { [i % GPUS]: bytes },
      gpu_utilization: { [i % GPUS]: util }
    };
  });
  // Each GPU's series follow from its kernels: memory summed, utilization the busiest one.
  const gpus = {};
  for (let g = 0; g < GPUS; g++) {
    const mine = kernelIds.filter((_, i) => i % GPUS === g).map(id => kernels[id]);
    gpus[g] = {
      t,
      memory_used: t.map((_, j) => mine.reduce((a, k) => a + k.gpu_memory_bytes[j], 0)),
      utilization: t.map((_, j) => Math.max(0, ...mine.map(k => k.sm_utilization[j])))
    };
  }
  return { now, interval: INTERVAL, gpus, kernels };
}

/** Top functions by self time of a CDP CPU profile (--profile). */
function printProfile(profile) {
  const dt = new Map();
  const byId = new Map(profile.nodes.map(n => [n.id, n]));
  profile.samples.forEach((id, i) => dt.set(id, (dt.get(id) || 0) + (profile.timeDeltas[i] || 0)));
  const self = new Map();
  for (const [id, us] of dt) {
    const f = byId.get(id).callFrame;
    const key = `${f.functionName || '(anonymous)'} ${f.url.split('/').pop()}:${f.lineNumber}`;
    self.set(key, (self.get(key) || 0) + us);
  }
  const total = [...self.values()].reduce((a, b) => a + b, 0);
  console.log(
    `CPU profile of the first panel phase, top self time (of ${(total / 1000).toFixed(0)} ms):`
  );
  [...self.entries()]
    .sort((a, b) => b[1] - a[1])
    .slice(0, 15)
    .forEach(([k, us]) => console.log(`  ${(us / 1000).toFixed(1).padStart(8)} ms  ${k}`));
}

async function waitForServer(url, ms) {
  const end = Date.now() + ms;
  while (Date.now() < end) {
    try {
      const res = await fetch(url);
      if (res.ok) return;
    } catch {
      /* not up yet */
    }
    await new Promise(r => setTimeout(r, 250));
  }
  throw new Error(`JupyterLab did not answer at ${url}`);
}

async function main() {
  const root = mkdtempSync(join(tmpdir(), 'gpushare-bench-'));
  const settingsDir = join(root, 'settings', 'jupyter-gpushare');
  // Long refresh interval: the benchmark triggers every refresh itself.
  const { mkdirSync } = await import('node:fs');
  mkdirSync(settingsDir, { recursive: true });
  writeFileSync(
    join(settingsDir, 'plugin.jupyterlab-settings'),
    JSON.stringify({
      refreshInterval: 3600000,
      historySeconds: HISTORY_SECONDS,
      notifications: false
    })
  );
  const lab = spawn(
    'jupyter',
    [
      'lab',
      '--no-browser',
      '--allow-root',
      `--port=${PORT}`,
      '--ServerApp.port_retries=0',
      '--IdentityProvider.token=',
      '--ServerApp.password=',
      '--ServerApp.disable_check_xsrf=True',
      `--ServerApp.root_dir=${root}`,
      `--LabApp.user_settings_dir=${join(root, 'settings')}`,
      `--LabApp.workspaces_dir=${join(root, 'workspaces')}`,
      '--LabApp.expose_app_in_browser=True'
    ],
    { stdio: ['ignore', 'ignore', 'pipe'], env: process.env }
  );
  let labLog = '';
  lab.stderr.on('data', d => (labLog += d));
  const base = `http://localhost:${PORT}`;
  let browser;
  try {
    await waitForServer(`${base}/lab`, 60000);
    browser = await chromium.launch({
      executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
      args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking']
    });
    const page = await browser.newPage({ viewport: { width: 1600, height: 1000 } });
    let seq = 0;
    let statusCalls = 0;
    let historyCalls = 0;
    await page.route('**/api/gpushare/status*', route => {
      statusCalls++;
      return route.fulfill({
        contentType: 'application/json',
        body: JSON.stringify(makeStatus(seq))
      });
    });
    let historyBytes = 0;
    await page.route('**/api/gpushare/history*', route => {
      historyCalls++;
      const seconds = Number(
        new URL(route.request().url()).searchParams.get('seconds') || HISTORY_SECONDS
      );
      const body = JSON.stringify(makeHistory(seq, seconds));
      historyBytes += body.length;
      return route.fulfill({ contentType: 'application/json', body });
    });
    await page.goto(`${base}/lab`);
    await page.waitForFunction(
      () => window.jupyterapp && window.jupyterapp.commands.hasCommand('gpushare:refresh'),
      null,
      { timeout: 60000 }
    );
    const cdp = await page.context().newCDPSession(page);
    await cdp.send('Performance.enable');
    const metrics = async () => {
      const { metrics: list } = await cdp.send('Performance.getMetrics');
      return Object.fromEntries(list.map(m => [m.name, m.value]));
    };
    const settle = () =>
      page.evaluate(
        () =>
          new Promise(r =>
            requestAnimationFrame(() => requestAnimationFrame(() => setTimeout(r, 20)))
          )
      );

    /** N refreshes: each waits for the status answer, then for the render to be painted. */
    async function phase(name, withHistory) {
      await settle();
      const before = await metrics();
      const t0 = Date.now();
      for (let i = 0; i < REFRESHES; i++) {
        seq++;
        const answered = [page.waitForResponse(r => r.url().includes('/api/gpushare/status'))];
        if (withHistory) {
          answered.push(page.waitForResponse(r => r.url().includes('/api/gpushare/history')));
        }
        await page.evaluate(() => window.jupyterapp.commands.execute('gpushare:refresh'));
        await Promise.all(answered);
        await settle();
      }
      const wall = (Date.now() - t0) / REFRESHES;
      const after = await metrics();
      const per = key => ((after[key] - before[key]) * 1000) / REFRESHES;
      return {
        phase: name,
        task_ms: per('TaskDuration'),
        script_ms: per('ScriptDuration'),
        layout_ms: per('LayoutDuration'),
        style_ms: per('RecalcStyleDuration'),
        wall_ms: wall,
        nodes: after.Nodes,
        heap_mb: after.JSHeapUsedSize / 2 ** 20
      };
    }

    // Let the lab finish starting (extensions, settings, workspace) before measuring.
    await page.waitForLoadState('networkidle');
    await page.waitForTimeout(3000);
    // Warm-up refreshes (JIT), not counted.
    for (let i = 0; i < 3; i++) {
      await page.evaluate(() => window.jupyterapp.commands.execute('gpushare:refresh'));
      await settle();
    }
    const KEYS = ['task_ms', 'script_ms', 'layout_ms', 'style_ms', 'wall_ms'];
    const median = values => {
      const sorted = [...values].sort((a, b) => a - b);
      const mid = Math.floor(sorted.length / 2);
      return sorted.length % 2 ? sorted[mid] : (sorted[mid - 1] + sorted[mid]) / 2;
    };
    const baselines = [];
    const panels = [];
    let firstOpen = null;
    let rows = 0;
    let charts = 0;
    for (let round = 0; round < ROUNDS; round++) {
      baselines.push(await phase(`baseline, round ${round + 1}`, false));
      const beforeOpen = await metrics();
      await page.evaluate(() => window.jupyterapp.commands.execute('gpushare:open-panel'));
      await page.waitForSelector('#jp-gpushare-panel .jp-GPUShare-kernel');
      await page.waitForFunction(
        n => document.querySelectorAll('#jp-gpushare-panel .jp-GPUShare-chart canvas').length >= n,
        GPUS,
        { timeout: 30000 }
      );
      await settle();
      if (firstOpen === null) {
        // First open: full history fetch, 8 uPlot charts and 50 rows created.
        const afterOpen = await metrics();
        firstOpen = {
          task_ms: (afterOpen.TaskDuration - beforeOpen.TaskDuration) * 1000,
          script_ms: (afterOpen.ScriptDuration - beforeOpen.ScriptDuration) * 1000
        };
        rows = await page.locator('#jp-gpushare-panel .jp-GPUShare-kernel').count();
        charts = await page.locator('#jp-gpushare-panel .jp-GPUShare-gpu').count();
        await page.screenshot({ path: join(here, 'panel_refresh.png') });
      }
      if (PROFILE && round === 0) {
        await cdp.send('Profiler.enable');
        await cdp.send('Profiler.start');
      }
      panels.push(await phase(`panel open, round ${round + 1}`, true));
      if (PROFILE && round === 0) {
        const { profile } = await cdp.send('Profiler.stop');
        printProfile(profile);
      }
      await page.evaluate(() => window.jupyterapp.shell.collapseRight());
      await settle();
    }
    const summarize = (name, list) => {
      const out = { phase: name };
      for (const key of KEYS) out[key] = median(list.map(p => p[key]));
      return out;
    };
    const baseline = summarize('baseline (median)', baselines);
    const panel = summarize('panel open (median)', panels);

    const fmt = v => v.toFixed(2).padStart(8);
    console.log(
      `jupyter-gpushare panel refresh: ${GPUS} GPUs (${charts} charts), ${KERNELS} kernels ` +
        `(${rows} rows), history ${HISTORY_SECONDS} s at ${INTERVAL} s, ` +
        `${ROUNDS} rounds x ${REFRESHES} refreshes per phase` +
        (SMOKE ? '  (--smoke: no figures)' : '')
    );
    console.log(`Chromium ${browser.version()}, ${process.platform}, CPU times per refresh in ms`);
    console.log('phase                        task    script    layout     style    wall');
    const line = p =>
      console.log(
        `${p.phase.padEnd(26)}${fmt(p.task_ms)}${fmt(p.script_ms)}${fmt(p.layout_ms)}${fmt(p.style_ms)}${fmt(p.wall_ms)}`
      );
    [...baselines, ...panels, baseline, panel].forEach(line);
    const delta = {};
    for (const key of KEYS.slice(0, 4)) delta[key] = panel[key] - baseline[key];
    console.log(
      `${'panel cost (difference)'.padEnd(26)}${fmt(delta.task_ms)}${fmt(delta.script_ms)}${fmt(delta.layout_ms)}${fmt(delta.style_ms)}`
    );
    console.log(
      `first open of the panel: task ${firstOpen.task_ms.toFixed(1)} ms, script ${firstOpen.script_ms.toFixed(1)} ms`
    );
    console.log(
      `requests: status ${statusCalls}, history ${historyCalls} ` +
        `(${(historyBytes / historyCalls / 1024).toFixed(0)} KiB each on average)`
    );
    if (JSON_OUT) {
      writeFileSync(
        JSON_OUT,
        JSON.stringify(
          {
            gpus: GPUS,
            kernels: KERNELS,
            refreshes: REFRESHES,
            rounds: ROUNDS,
            chromium: browser.version(),
            baselines,
            panels,
            baseline,
            panel,
            delta,
            firstOpen
          },
          null,
          2
        )
      );
    }
  } catch (error) {
    console.error(labLog.slice(-3000));
    throw error;
  } finally {
    await browser?.close();
    lab.kill('SIGTERM');
    await new Promise(r => lab.once('exit', r));
    rmSync(root, { recursive: true, force: true });
  }
}

main().catch(error => {
  console.error(error);
  process.exit(1);
});
