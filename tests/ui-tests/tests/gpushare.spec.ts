/**
 * jupyter-gpushare panel against the real server extension on the simulated GPU node:
 * two notebooks allocate 1 GiB each; release one from the panel, restore it by running a
 * cell, pin the other and release it by hand all the same; toasts stay clear of the panel.
 * Then two notebooks of one name in two folders, one keeping data on a GPU it never
 * computes on: rows that tell them apart, per-GPU utilization. Screenshots go to artifacts/.
 */
import { expect, galata, IJupyterLabPageFixture, test } from '@jupyterlab/galata';
import { Locator } from '@playwright/test';
import * as path from 'path';
import { openLab, patientApplication } from './patience';

const GiB = 1024 ** 3;
const ARTIFACTS = path.resolve(__dirname, '..', 'artifacts');
const ALLOC =
  'from jupyter_gpushare.sim import simgpu\n' +
  'import numpy as np\n' +
  'x = simgpu.zeros((256, 1024, 1024), dtype=np.float32, device=0)\n' +
  'print("allocated", x.nbytes)';

function panel(page: IJupyterLabPageFixture): Locator {
  return page.locator('#jp-gpushare-panel');
}

function row(page: IJupyterLabPageFixture, name: string): Locator {
  return panel(page)
    .locator('.jp-GPUShare-kernel')
    .filter({ has: page.locator('.jp-GPUShare-kernelName', { hasText: name }) });
}

async function openPanel(page: IJupyterLabPageFixture): Promise<void> {
  const tab = page.locator('.jp-SideBar.jp-mod-right .lm-TabBar-tab[data-id="jp-gpushare-panel"]');
  await expect(tab).toBeVisible();
  if (!(await panel(page).isVisible())) {
    await tab.click();
  }
  await expect(panel(page)).toBeVisible();
}

/** Whether `locator` lies wholly left of the panel (does not cover any of its rows). */
async function leftOfPanel(page: IJupyterLabPageFixture, locator: Locator): Promise<boolean> {
  const box = await locator.boundingBox();
  const area = await panel(page).boundingBox();
  return box !== null && area !== null && box.x + box.width <= area.x;
}

async function gpuUsed(page: IJupyterLabPageFixture, index: number): Promise<number> {
  const value = await panel(page)
    .locator(`.jp-GPUShare-gpu[data-gpu-index="${index}"]`)
    .getAttribute('data-memory-used');
  return Number(value);
}

/**
 * Write a one-cell notebook (kernelspec python3, so it starts its kernel without asking),
 * open it, run the cell and wait for its output. Writing the file is deterministic where
 * File > New > Notebook's kernel dialog is not.
 */
async function allocatingNotebook(
  page: IJupyterLabPageFixture,
  dir: string,
  name: string,
  extra = ''
): Promise<void> {
  const notebook = {
    cells: [
      { cell_type: 'code', source: ALLOC + extra, metadata: {}, outputs: [], execution_count: null }
    ],
    metadata: {
      kernelspec: { name: 'python3', display_name: 'Python 3 (ipykernel)', language: 'python' }
    },
    nbformat: 4,
    nbformat_minor: 4
  };
  await page.contents.uploadContent(JSON.stringify(notebook), 'text', `${dir}/${name}`);
  await page.notebook.openByPath(`${dir}/${name}`);
  // The notebook just opened is the current one; its tab label (the file name) may be
  // another notebook's too, so wait for its session rather than activate a tab by name.
  await page.evaluate(async () => {
    await (window as any).galata.app.shell.currentWidget.sessionContext.ready;
  });
  // In place: Shift+Enter would leave an empty cell under it (seen in the README screenshot).
  await page.notebook.runCell(0, true);
  await expect(
    page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output').first()
  ).toContainText(`allocated ${GiB}`);
}

test.use({
  autoGoto: false, // openLab: galata's navigation with a patient bound
  viewport: { width: 1366, height: 1000 },
  waitForApplication: patientApplication
});
test.beforeEach(async ({ page, tmpPath }) => openLab(page, tmpPath));

/** Save the panel (scrolled to its top) as artifacts/NAME.png. */
async function shot(page: IJupyterLabPageFixture, name: string): Promise<void> {
  await panel(page).evaluate(node => (node.scrollTop = 0));
  await panel(page).screenshot({ path: path.join(ARTIFACTS, `${name}.png`) });
}

test('the GPU panel opens from the right sidebar and shows the simulated GPUs', async ({
  page
}) => {
  await openPanel(page);
  const gpus = panel(page).locator('.jp-GPUShare-gpu');
  await expect(gpus).toHaveCount(2);
  await expect(gpus.first()).toContainText('GPU 0');
  await expect(gpus.first().locator('.jp-GPUShare-gpuStats').first()).toContainText('16.0 GiB');
  await expect(panel(page).locator('.jp-GPUShare-summary')).toContainText('backend simulated');
  // The server's default, said as one (a kernel's own shows in its row).
  await expect(panel(page).locator('.jp-GPUShare-summary')).toContainText(
    'no automatic release by default'
  );
  // The chart canvas is drawn once history arrives.
  await expect(gpus.first().locator('.jp-GPUShare-chart canvas').first()).toBeVisible();
  // Its memory axis runs to the GPU's total, its time axis has several ages ending at "now".
  const chart = gpus.first().locator('.jp-GPUShare-chart');
  await expect(chart).toHaveAttribute('data-memory-axis-top', String(16 * GiB));
  await expect(chart).toHaveAttribute('data-time-labels', /^(-\d+ (s|min) \| )+now$/);
  // One legend for every chart: the lines, in a line; what they mean on hover.
  const legend = panel(page).locator('.jp-GPUShare-chart-legend');
  await expect(legend).toHaveCount(1);
  await expect(legend.locator('[data-kind="used"]')).toHaveText('GPU used');
  await expect(legend.locator('[data-kind="sm"]')).toHaveText('SM %');
  await expect(legend.locator('[data-kind="sm"]')).toHaveAttribute('title', /SM utilization/);
  // No paragraph of explanations: they are tooltips.
  await expect(panel(page).locator('.jp-GPUShare-efficiency')).toHaveAttribute('title', /Held:/);
  await shot(page, 'panel-empty');

  // The dark theme: the charts are rebuilt with the theme's colors and still drawn.
  await page.theme.setDarkTheme();
  await expect(gpus.first().locator('.jp-GPUShare-chart canvas').first()).toBeVisible();
  await expect(panel(page)).toHaveCSS('background-color', 'rgb(33, 33, 33)'); // --jp-layout-color1 of the dark theme;
  await shot(page, 'panel-dark');
});

test('release, restore and pin two kernels from the panel', async ({ page, tmpPath }) => {
  await allocatingNotebook(page, tmpPath, 'alloc-a.ipynb');
  // B also computes for a moment, so the chart shows utilization next to held memory.
  await allocatingNotebook(page, tmpPath, 'alloc-b.ipynb', '\nsimgpu.burn(1.5)');
  await openPanel(page);

  const a = row(page, 'alloc-a.ipynb');
  const b = row(page, 'alloc-b.ipynb');
  await expect(a).toHaveCount(1);
  await expect(b).toHaveCount(1);
  for (const r of [a, b]) {
    await expect(r).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
    await expect(r.locator('.jp-GPUShare-kernelStats-memory')).toHaveText('1.0 GiB on GPU 0');
  }
  const gpu0 = panel(page).locator('.jp-GPUShare-gpu[data-gpu-index="0"]');
  await expect(gpu0.locator('.jp-GPUShare-chart canvas').first()).toBeVisible();
  await expect(panel(page).locator('.jp-GPUShare-efficiency-value')).toContainText('Efficiency');
  await expect.poll(() => gpuUsed(page, 0)).toBeGreaterThanOrEqual(2 * GiB);
  const usedBefore = await gpuUsed(page, 0);
  // The legend names each kernel on the charts in its chart (and row) color, once.
  const legend = panel(page).locator('.jp-GPUShare-chart-legend [data-kind="kernel"]');
  await expect(legend).toHaveText(['alloc-a.ipynb', 'alloc-b.ipynb']);
  for (const [i, r] of [a, b].entries()) {
    const swatch = r.locator('.jp-GPUShare-kernel-swatch');
    const color = await swatch.evaluate(node => getComputedStyle(node).backgroundColor);
    await expect(legend.nth(i).locator('.jp-GPUShare-chart-legend-swatch')).toHaveCSS(
      'background-color',
      color
    );
  }
  // 2 GiB of 16 GiB: the memory axis is the GPU's, not what is held; B's 1.5 s burst is a peak.
  await expect(gpu0.locator('.jp-GPUShare-chart')).toHaveAttribute(
    'data-memory-axis-top',
    String(16 * GiB)
  );
  await expect(gpu0.locator('.jp-GPUShare-gpuStats').first()).toContainText(/peak [1-9]\d* %/);
  await shot(page, 'panel-two-kernels');

  // Release A from the panel: its memory moves to the host and GPU 0's use drops.
  await a.locator('button[data-action="release"]').click();
  await expect(a).toHaveAttribute('data-state', 'released');
  await expect(a.locator('.jp-GPUShare-kernelStats-memory')).toHaveText('1.0 GiB on host');
  await expect(a.locator('button[data-action="release"]')).toBeDisabled();
  await expect(a.locator('button[data-action="restore"]')).toBeEnabled();
  await expect.poll(() => gpuUsed(page, 0)).toBeLessThanOrEqual(usedBefore - GiB);
  await expect(gpu0).toHaveAttribute('data-released-bytes', String(GiB));
  // The server's event turns into a notification, beside the panel rather than over its rows.
  const toast = page.locator('.Toastify__toast').filter({ hasText: 'Released 1.0 GiB' });
  await expect(toast).toBeVisible();
  // named as its row is; eager mode: any next cell brings it back
  await expect(toast).toContainText(
    'of alloc-a.ipynb to host memory; it comes back before the next cell'
  );
  await expect.poll(() => leftOfPanel(page, toast)).toBe(true); // once it has slid in
  await page.screenshot({ path: path.join(ARTIFACTS, 'toast-beside-panel.png') });
  await shot(page, 'panel-released');

  // The status bar follows the current notebook; switch to A and see it released. (This test
  // is about a cell's restore: the lab's restore ahead of the cell, which switching to A
  // asks for, is turned away here and tested on its own below.)
  await page.route(/\/api\/gpushare\/kernels\/[^/?]+\/restore(\?|$)/, route =>
    (route.request().postData() ?? '').includes('activity') ? route.abort() : route.continue()
  );
  await page.notebook.activate('alloc-a.ipynb');
  await expect(page.locator('.jp-GPUShare-statusItem')).toHaveText(
    'GPU released (1.0 GiB on host)'
  );

  // Running a cell in A restores it before the cell runs.
  await page.notebook.addCell('code', 'print("still here", x.shape)');
  await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
  await expect(
    page.locator('.jp-OutputArea-output').filter({ hasText: 'still here' })
  ).toContainText('(256, 1024, 1024)');
  await expect(a).not.toHaveAttribute('data-state', /released|restoring/);
  await expect(a).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
  await expect.poll(() => gpuUsed(page, 0)).toBeGreaterThanOrEqual(usedBefore);
  // a duration, not an age
  await expect(a.locator('.jp-GPUShare-kernelStats-timing')).toContainText(
    /last restore took \d+(\.\d)? s/
  );
  // the status bar says what its percentage is
  await expect(page.locator('.jp-GPUShare-statusItem')).toHaveText(/^GPU 1\.0 GiB · \d+ % SM$/);

  // A's own idle timeout shows in its row; the header keeps the server's, as the default.
  await page.notebook.addCell('code', '%gpushare idle-timeout 3600');
  await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
  await expect(a.locator('.jp-GPUShare-kernelStats-timing')).toContainText(
    /release after 1 h idle \(in (59 min( \d+ s)?|1 h)\)/
  );
  await expect(panel(page).locator('.jp-GPUShare-summary')).toContainText(
    'no automatic release by default'
  );
  await expect(b.locator('.jp-GPUShare-kernelStats-timing')).toContainText('no automatic release');

  // Pin B: never released automatically, and still releasable by hand (as over REST).
  await b.locator('button[data-action="pin"]').click();
  await expect(b).toHaveAttribute('data-pinned', 'true');
  await expect(b.locator('.jp-GPUShare-badge-pinned')).toBeVisible();
  await expect(b.locator('button[data-action="pin"]')).toHaveText('Unpin');
  await expect(b.locator('.jp-GPUShare-kernelStats-timing')).toContainText(
    'never released automatically'
  );
  await expect(b.locator('button[data-action="release"]')).toBeEnabled();
  await expect(a.locator('button[data-action="release"]')).toBeEnabled();
  await shot(page, 'panel-restored-pinned');
  // The README's screenshot (docs/images/lab-with-panel.png is a copy of it).
  await page.screenshot({ path: path.join(ARTIFACTS, 'lab-with-panel.png') });
  await b.locator('button[data-action="release"]').click();
  await expect(b).toHaveAttribute('data-state', 'released');
  await expect(b).toHaveAttribute('data-pinned', 'true');
  await expect(b.locator('.jp-GPUShare-kernelError')).toBeHidden();
  await b.locator('button[data-action="restore"]').click();
  await expect(b).not.toHaveAttribute('data-state', /released|restoring/);
  await expect(b).toHaveAttribute('data-gpu-memory-bytes', String(GiB));

  // Clicking a kernel's name brings its notebook to the front.
  await page.notebook.activate('alloc-a.ipynb');
  await b.locator('.jp-GPUShare-kernelName').click();
  await expect.poll(() => page.activity.isTabActive('alloc-b.ipynb')).toBe(true);
});

test('rows tell two notebooks of one name apart; utilization is per GPU', async ({
  page,
  tmpPath
}) => {
  // "one/same.ipynb" keeps 256 MiB on GPU 1 but computes only on GPU 0.
  await allocatingNotebook(
    page,
    tmpPath,
    'one/same.ipynb',
    '\ny = simgpu.zeros((64, 1024, 1024), dtype=np.float32, device=1)\nsimgpu.burn(1.5, device=0)'
  );
  await allocatingNotebook(page, tmpPath, 'two/same.ipynb');
  await openPanel(page);

  const one = panel(page).locator(`.jp-GPUShare-kernel[data-path="${tmpPath}/one/same.ipynb"]`);
  const two = panel(page).locator(`.jp-GPUShare-kernel[data-path="${tmpPath}/two/same.ipynb"]`);
  // Enough of the path to differ; the whole path on hover.
  await expect(one.locator('.jp-GPUShare-kernelName')).toHaveText('one/same.ipynb');
  await expect(two.locator('.jp-GPUShare-kernelName')).toHaveText('two/same.ipynb');
  await expect(one.locator('.jp-GPUShare-kernelName')).toHaveAttribute(
    'title',
    new RegExp(`^${tmpPath}/one/same\\.ipynb\\nkernel [0-9a-f-]+$`)
  );
  await one.locator('.jp-GPUShare-kernelName').hover();

  // The row shows utilization per GPU; GPU 1, where nothing computed, held its bytes idle.
  await expect(one.locator('.jp-GPUShare-kernelStats-util')).toHaveText(
    /^SM \d+ % on GPU 0 · 0 % on GPU 1$/
  );
  const released = (index: number) =>
    panel(page).locator(
      `.jp-GPUShare-gpu[data-gpu-index="${index}"] .jp-GPUShare-gpuStats-released`
    );
  await expect(released(1)).toContainText('held while computing 0 %');
  await expect(released(0)).toContainText(/held while computing [1-9]\d* %/);
  await shot(page, 'panel-same-names-per-gpu');
});

test.describe('with the notifications setting off', () => {
  // galata serves the lab's settings from the page (mockSettings); set ours there
  test.use({
    mockSettings: {
      ...galata.DEFAULT_SETTINGS,
      'jupyter-gpushare:plugin': { notifications: false }
    }
  });

  test('a release shows no toast', async ({ page, tmpPath }) => {
    await allocatingNotebook(page, tmpPath, 'quiet.ipynb');
    await openPanel(page);
    const quiet = row(page, 'quiet.ipynb');
    await expect(quiet).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
    await quiet.locator('button[data-action="release"]').click();
    // Sample for 3 s rather than expect(...).toHaveCount(0), which would retry until a toast
    // that did appear had closed by itself, and so pass either way.
    const toasts = page.locator('.Toastify__toast').filter({ hasText: 'Released' });
    const seen: number[] = [];
    for (let i = 0; i < 12; i++) {
      seen.push(await toasts.count());
      await page.waitForTimeout(250);
    }
    await expect(quiet).toHaveAttribute('data-state', 'released');
    expect(Math.max(...seen)).toBe(0);
  });
});

/** Whether nothing is drawn on the outermost pixels of a chart's canvas (no label cut off). */
async function chartEdgesBlank(chart: Locator): Promise<{ blank: boolean; inked: string[] }> {
  return chart
    .locator('canvas')
    .first()
    .evaluate((canvas: HTMLCanvasElement) => {
      const ctx = canvas.getContext('2d')!;
      const { width, height } = canvas;
      const inked: string[] = [];
      const edges: [string, number, number, number, number][] = [
        ['top', 0, 0, width, 1],
        ['bottom', 0, height - 1, width, 1],
        ['left', 0, 0, 1, height],
        ['right', width - 1, 0, 1, height]
      ];
      for (const [edge, x, y, w, h] of edges) {
        const alpha = ctx.getImageData(x, y, w, h).data.filter((_, i) => i % 4 === 3);
        if (alpha.some(a => a > 0)) {
          inked.push(edge);
        }
      }
      return { blank: inked.length === 0, inked };
    });
}

test('names, per-GPU utilization and chart labels fit the panel at its default width', async ({
  page,
  tmpPath
}) => {
  // The demo's notebook, pinned (two badges), holding memory on both GPUs; and a long name.
  await allocatingNotebook(
    page,
    tmpPath,
    'gpushare-demo.ipynb',
    '\ny = simgpu.zeros((64, 1024, 1024), dtype=np.float32, device=1)\nsimgpu.burn(1.5, device=0)'
  );
  const longName = 'a-notebook-with-a-name-much-longer-than-the-panel-is-wide.ipynb';
  await allocatingNotebook(page, tmpPath, longName);
  await openPanel(page);
  const demo = row(page, 'gpushare-demo.ipynb');
  await demo.locator('button[data-action="pin"]').click();
  await expect(demo.locator('.jp-GPUShare-badge-pinned')).toBeVisible();
  await expect(demo.locator('.jp-GPUShare-kernelStats-util')).toHaveText(
    /^SM \d+ % on GPU 0 · 0 % on GPU 1$/
  );

  // The whole name shows (the badges move under it if need be), and it is not cut.
  const fits = (locator: Locator) =>
    locator.evaluate(node => node.scrollWidth <= node.clientWidth + 0.5);
  await expect(demo.locator('.jp-GPUShare-kernelName')).toHaveText('gpushare-demo.ipynb');
  // Read as one name, though drawn in two parts.
  await expect(demo.getByRole('link', { name: 'gpushare-demo.ipynb', exact: true })).toBeVisible();
  expect(await fits(demo.locator('.jp-GPUShare-kernelName-head'))).toBe(true);
  const box = (await demo.boundingBox())!;
  for (const badge of ['.jp-GPUShare-badge-active', '.jp-GPUShare-badge-pinned']) {
    const b = (await demo.locator(badge).boundingBox())!;
    expect(b.x + b.width).toBeLessThanOrEqual(box.x + box.width + 0.5);
  }

  // A name longer than the panel is cut in its middle: ".ipynb" stays in view.
  const long = panel(page).locator(`.jp-GPUShare-kernel[data-path="${tmpPath}/${longName}"]`);
  const name = long.locator('.jp-GPUShare-kernelName');
  await expect(name).toHaveText(longName);
  expect(await fits(long.locator('.jp-GPUShare-kernelName-head'))).toBe(false);
  await expect(long.locator('.jp-GPUShare-kernelName-tail')).toHaveText(/\.ipynb$/);
  const tail = (await long.locator('.jp-GPUShare-kernelName-tail').boundingBox())!;
  const longBox = (await long.boundingBox())!;
  expect(tail.x + tail.width).toBeLessThanOrEqual(longBox.x + longBox.width + 0.5);
  await expect(name).toHaveAttribute('title', new RegExp(`^${tmpPath}/${longName}\\n`));

  // The two-GPU utilization is one line, inside the row.
  const util = demo.locator('.jp-GPUShare-kernelStats-util');
  const lines = await util.evaluate(node => {
    const range = document.createRange();
    range.selectNodeContents(node);
    return new Set([...range.getClientRects()].map(r => Math.round(r.top))).size;
  });
  expect(lines).toBe(1);
  const u = (await util.boundingBox())!;
  expect(u.x + u.width).toBeLessThanOrEqual(box.x + box.width + 0.5);
  // The memory and the sparkline share the line above it.
  const sameLine = async (r: Locator, a: string, b: string) => {
    const boxA = (await r.locator(a).boundingBox())!;
    const boxB = (await r.locator(b).boundingBox())!;
    return Math.abs(boxA.y + boxA.height / 2 - (boxB.y + boxB.height / 2)) < 4;
  };
  const memory = (await demo.locator('.jp-GPUShare-kernelStats-memory').boundingBox())!;
  const spark = (await demo.locator('.jp-GPUShare-sparkline').boundingBox())!;
  expect(await sameLine(demo, '.jp-GPUShare-kernelStats-memory', '.jp-GPUShare-sparkline')).toBe(
    true
  );
  expect(u.y).toBeGreaterThanOrEqual(memory.y + memory.height - 0.5);
  expect(spark.x + spark.width).toBeLessThanOrEqual(box.x + box.width + 0.5);
  // One GPU: memory, utilization and sparkline on one line.
  for (const part of ['.jp-GPUShare-kernelStats-util', '.jp-GPUShare-sparkline']) {
    expect(await sameLine(long, '.jp-GPUShare-kernelStats-memory', part)).toBe(true);
  }
  // "free 16.0 GiB" never breaks before its unit.
  const stats = panel(page).locator('.jp-GPUShare-gpu').first().locator('.jp-GPUShare-gpuStats');
  for (const clause of await stats.first().locator('.jp-GPUShare-clause').all()) {
    expect(await clause.evaluate(node => node.getClientRects().length)).toBe(1);
  }

  // Nothing of the charts' axes (labels included) is cut at the canvas' edges.
  for (const chart of await panel(page).locator('.jp-GPUShare-chart').all()) {
    await expect(chart.locator('canvas').first()).toBeVisible();
    expect(await chartEdgesBlank(chart)).toEqual({ blank: true, inked: [] });
  }
  await shot(page, 'panel-names-fit');
});

test.describe('with a poll once in ten minutes', () => {
  // Everything the panel shows below within a minute comes from a refresh after the action
  // or on the server's event, not from the poll. (A minute, not seconds: a simulated release
  // on a loaded 2-core machine took over 10 s.)
  test.use({
    mockSettings: {
      ...galata.DEFAULT_SETTINGS,
      'jupyter-gpushare:plugin': { refreshInterval: 600_000 }
    }
  });
  const SOON = { timeout: 60_000 };

  test('the panel follows a release at once, from the panel or from a cell', async ({
    page,
    tmpPath
  }) => {
    await allocatingNotebook(page, tmpPath, 'follow.ipynb');
    await openPanel(page);
    // The kernel started after the page's last poll: the Refresh command shows it (once the
    // server has seen its allocation).
    const r = row(page, 'follow.ipynb');
    await expect
      .poll(async () => {
        await page.evaluate(() => (window as any).galata.app.commands.execute('gpushare:refresh'));
        return r.getAttribute('data-gpu-memory-bytes');
      }, SOON)
      .toBe(String(GiB));
    await expect.poll(() => gpuUsed(page, 0), SOON).toBeGreaterThanOrEqual(GiB);
    const usedBefore = await gpuUsed(page, 0);

    // Every text the badge shows, in order.
    await r
      .locator('.jp-GPUShare-badge')
      .first()
      .evaluate(node => {
        const seen: string[] = [node.textContent ?? ''];
        (window as any).gpushareBadges = seen;
        new MutationObserver(() => seen.push(node.textContent ?? '')).observe(node, {
          childList: true,
          characterData: true,
          subtree: true
        });
      });
    // Hold the release request in the browser: what the row shows meanwhile is the panel's
    // own doing, nothing from the server yet.
    let letGo!: () => void;
    const gate = new Promise<void>(resolve => (letGo = resolve));
    // (the lab adds "?<time>" to the URL)
    const release = /\/api\/gpushare\/kernels\/[^/?]+\/release(\?|$)/;
    let held = 0;
    await page.route(release, async route => {
      held++;
      await gate;
      await route.continue();
    });
    await r.locator('button[data-action="release"]').click();
    await expect(r.locator('.jp-GPUShare-badge').first()).toHaveText('releasing…');
    await expect(r.locator('.jp-GPUShare-kernelStats-timing')).not.toContainText(
      /release (after|if)/
    );
    await expect(r.locator('button[data-action="release"]')).toBeDisabled();
    await expect(page.locator('.jp-GPUShare-statusItem')).toHaveText('GPU releasing…');
    expect(held).toBe(1);
    letGo();
    await expect(r).toHaveAttribute('data-state', 'released', SOON);
    await page.unroute(release);
    // The GPU's figures too: the whole status was asked again, not only the row patched.
    await expect.poll(() => gpuUsed(page, 0), SOON).toBeLessThanOrEqual(usedBefore - GiB);
    // Then "released", and never the state from before the click again.
    const badges: string[] = await page.evaluate(() => (window as any).gpushareBadges);
    expect(badges[0]).toMatch(/^(active|idle)$/);
    expect(badges[1]).toBe('releasing…');
    expect(badges.slice(1).filter(b => b !== 'releasing…')).toEqual(['released']);

    // A cell brings it back; `%gpushare release` in a cell releases it: the row follows the
    // server's events at once.
    await page.notebook.activate('follow.ipynb');
    await page.notebook.addCell('code', 'print("back", x.shape)');
    await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
    await expect(page.locator('.jp-OutputArea-output').filter({ hasText: 'back' })).toBeVisible();
    await expect(r).not.toHaveAttribute('data-state', /released|restoring/, SOON);
    await page.notebook.addCell('code', '%gpushare release');
    await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
    await expect(r).toHaveAttribute('data-state', 'released', SOON);
    await expect(r.locator('.jp-GPUShare-kernelStats-memory')).toHaveText('1.0 GiB on host');
  });
});

test('a released kernel is restored ahead when its notebook is focused and a cell typed', async ({
  page,
  tmpPath
}) => {
  await allocatingNotebook(page, tmpPath, 'ahead-a.ipynb');
  await allocatingNotebook(page, tmpPath, 'ahead-b.ipynb'); // B is the current notebook now
  await openPanel(page);
  const a = row(page, 'ahead-a.ipynb');
  await expect(a).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
  const kernelId = async (): Promise<string> => {
    const status = await (await page.request.get('/api/gpushare/status')).json();
    return status.kernels.find((k: any) => k.path.endsWith('ahead-a.ipynb')).id;
  };
  const id = await kernelId();
  const kernel = async (): Promise<any> => {
    const status = await (await page.request.get('/api/gpushare/status')).json();
    return status.kernels.find((k: any) => k.id === id);
  };

  // Every gpushare event of A the server pushes, with when the page had it.
  await page.evaluate(kid => {
    const seen: any[] = [];
    (window as any).gpushareEvents = seen;
    (window as any).galata.app.serviceManager.events.stream.connect((_: any, e: any) => {
      if (e.schema_id?.includes('jupyter_gpushare') && e.kernel_id === kid) {
        seen.push({ ...e, at: Date.now() });
      }
    });
  }, id);

  await a.locator('button[data-action="release"]').click();
  await expect(a).toHaveAttribute('data-state', 'released');
  const restoresBefore = (await kernel()).restores;

  // The person comes back to A: focuses it and types a cell (without running it yet).
  await page.notebook.activate('ahead-a.ipynb');
  await page.notebook.addCell('code', 'print("back", x.shape)');
  await expect
    .poll(async () => (await kernel()).state, { timeout: 30_000 })
    .toMatch(/^(active|idle)$/);
  const restored = async () =>
    (await page.evaluate(() => (window as any).gpushareEvents)).filter(
      (e: any) => e.action === 'restored'
    );
  await expect.poll(async () => (await restored()).length).toBe(1);
  expect((await restored())[0].reason).toBe('activity');

  // Then runs it: the state is there already; no restore, nothing of gpushare's in the cell.
  const sentAt = await page.evaluate(() => Date.now());
  await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
  const output = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output');
  await expect(output.filter({ hasText: 'back' })).toContainText('(256, 1024, 1024)');
  await expect(output.filter({ hasText: 'gpushare:' })).toHaveCount(0);
  const events: any[] = await page.evaluate(() => (window as any).gpushareEvents);
  const restores = events.filter((e: any) => e.action.startsWith('restore'));
  expect(restores.map((e: any) => [e.action, e.reason])).toEqual([['restored', 'activity']]);
  expect(restores[0].at).toBeLessThan(sentAt); // ended before the cell was sent
  const after = await kernel();
  expect(after.restores).toBe(restoresBefore + 1); // one restore: the one ahead
  expect(after.state).toMatch(/^(active|idle)$/);
});

test('a released kernel is restored ahead when its person comes back to the page or presses a key in it', async ({
  page,
  tmpPath
}) => {
  await allocatingNotebook(page, tmpPath, 'back-a.ipynb');
  await allocatingNotebook(page, tmpPath, 'back-b.ipynb'); // B is in front now
  await openPanel(page);
  const a = row(page, 'back-a.ipynb');
  const b = row(page, 'back-b.ipynb');
  await expect(a).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
  await expect(b).toHaveAttribute('data-gpu-memory-bytes', String(GiB));
  const status = async (): Promise<any[]> =>
    (await (await page.request.get('/api/gpushare/status')).json()).kernels;
  const idOf = async (name: string): Promise<string> =>
    (await status()).find((k: any) => k.path.endsWith(name)).id;
  const ids = { a: await idOf('back-a.ipynb'), b: await idOf('back-b.ipynb') };

  // Every `restored` event the server pushes, with its kernel and reason.
  await page.evaluate(() => {
    const seen: any[] = [];
    (window as any).gpushareRestored = seen;
    (window as any).galata.app.serviceManager.events.stream.connect((_: any, e: any) => {
      if (e.schema_id?.includes('jupyter_gpushare') && e.action === 'restored') {
        seen.push([e.kernel_id, e.reason]);
      }
    });
  });
  const restored = async (): Promise<string[][]> =>
    page.evaluate(() => (window as any).gpushareRestored);

  // B released from the panel (nothing pressed in the notebook), then its person comes back:
  // the page is shown again, B in front. No edit, no tab switch: the return alone asks.
  await b.locator('button[data-action="release"]').click();
  await expect(b).toHaveAttribute('data-state', 'released');
  await page.evaluate(() => document.dispatchEvent(new Event('visibilitychange')));
  await expect.poll(restored).toEqual([[ids.b, 'activity']]);
  await expect(b).not.toHaveAttribute('data-state', /released|restoring/);

  // A in front (resident: nothing asked), released from the panel; its person's first act is
  // the Shift of a Shift-Enter on a cell as it is: the key alone asks, before the cell is run.
  await page.notebook.activate('back-a.ipynb');
  await a.locator('button[data-action="release"]').click();
  await expect(a).toHaveAttribute('data-state', 'released');
  expect(await restored()).toEqual([[ids.b, 'activity']]);
  await page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-Notebook').focus();
  await page.keyboard.press('Shift');
  await expect.poll(restored).toEqual([
    [ids.b, 'activity'],
    [ids.a, 'activity']
  ]);
  await expect(a).not.toHaveAttribute('data-state', /released|restoring/);

  // Then the cell runs on the state already there: no restore of its own, no gpushare line.
  await page.notebook.addCell('code', 'print("back", x.shape)');
  await page.notebook.runCell((await page.notebook.getCellCount()) - 1);
  const output = page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output');
  await expect(output.filter({ hasText: 'back' })).toContainText('(256, 1024, 1024)');
  await expect(output.filter({ hasText: 'gpushare:' })).toHaveCount(0);
  expect((await restored()).filter(([id]) => id === ids.a)).toEqual([[ids.a, 'activity']]);
});
