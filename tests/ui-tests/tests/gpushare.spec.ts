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
  await page.notebook.runCell(0);
  await expect(
    page.locator('.jp-NotebookPanel:not(.lm-mod-hidden) .jp-OutputArea-output').first()
  ).toContainText(`allocated ${GiB}`);
}

test.use({ autoGoto: true, viewport: { width: 1366, height: 1000 } });

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
  // The chart canvas is drawn once history arrives.
  await expect(gpus.first().locator('.jp-GPUShare-chart canvas').first()).toBeVisible();
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

  // The status bar follows the current notebook; switch to A and see it released.
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
  await expect(a.locator('.jp-GPUShare-kernelStats-timing')).toContainText('last restore');
  await expect(page.locator('.jp-GPUShare-statusItem')).toContainText('GPU 1.0 GiB');

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
