/**
 * The panel on the NVML backend of a machine without NVIDIA GPUs (CI): it says telemetry is
 * unavailable and why, instead of an empty or broken panel. Runs against the second server
 * of playwright.config.js. Skipped where NVML does find GPUs.
 */
import { expect, test } from '@jupyterlab/galata';
import * as path from 'path';
import { openLab, patientApplication } from './patience';

const ARTIFACTS = path.resolve(__dirname, '..', 'artifacts');

test.use({
  baseURL: process.env.GPUSHARE_UI_NVML_URL ?? 'http://localhost:8896',
  autoGoto: false, // openLab: galata's navigation with a patient bound
  waitForApplication: patientApplication
});
test.beforeEach(async ({ page, tmpPath }) => openLab(page, tmpPath));

test('without NVML the panel shows the reason and no GPUs', async ({ page, request, baseURL }) => {
  const status = await (await request.get(`${baseURL}/api/gpushare/status`)).json();
  test.skip(status.available, 'NVML works on this machine; nothing unavailable to show');
  expect(status.reason).toBeTruthy();

  await page.evaluate(() => (window as any).jupyterapp.commands.execute('gpushare:open-panel'));
  const panel = page.locator('#jp-gpushare-panel');
  await expect(panel).toBeVisible();
  const message = panel.locator('.jp-GPUShare-message');
  await expect(message).toContainText('GPU telemetry unavailable');
  await expect(message).toContainText(status.reason);
  await expect(message).toHaveAttribute('data-kind', 'warning');
  await expect(panel.locator('.jp-GPUShare-gpu')).toHaveCount(0);
  await expect(panel.locator('.jp-GPUShare-summary')).toContainText('backend nvml');
  await panel.screenshot({ path: path.join(ARTIFACTS, 'panel-nvml-unavailable.png') });
});
