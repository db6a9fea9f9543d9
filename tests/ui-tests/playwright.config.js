/**
 * Playwright configuration for the jupyter-gpushare UI tests.
 *
 * Uses the system Chromium (Debian's /usr/bin/chromium, or CHROMIUM_PATH): Playwright never
 * downloads a browser here (PLAYWRIGHT_SKIP_BROWSER_DOWNLOAD=1 in run.sh).
 */
const baseConfig = require('@jupyterlab/galata/lib/playwright-config');

const port = process.env.GPUSHARE_UI_PORT || '8895';
const baseURL = `http://localhost:${port}`;
const nvmlPort = String(Number(port) + 1);
const nvmlURL = `http://localhost:${nvmlPort}`;
process.env.GPUSHARE_UI_NVML_URL = nvmlURL;

module.exports = {
  ...baseConfig,
  testDir: './tests',
  outputDir: './test-results',
  reporter: [[process.env.CI ? 'line' : 'list'], ['html', { open: 'never' }]],
  // One lab server, kernels are CPU-heavy on 2 cores: run the specs one at a time.
  workers: 1,
  fullyParallel: false,
  retries: 0,
  timeout: 180_000,
  expect: { timeout: 30_000 },
  use: {
    ...baseConfig.use,
    baseURL,
    trace: 'retain-on-failure',
    video: 'off',
    launchOptions: {
      executablePath: process.env.CHROMIUM_PATH || '/usr/bin/chromium',
      args: ['--no-sandbox', '--disable-gpu', '--disable-background-networking']
    }
  },
  webServer: [
    {
      // The server's log goes to artifacts/ so a failure in CI can be read afterwards.
      command:
        'mkdir -p artifacts && exec jupyter lab --config jupyter_server_test_config.py > artifacts/jupyter-server.log 2>&1',
      url: `${baseURL}/lab`,
      timeout: 120_000,
      reuseExistingServer: !process.env.CI,
      env: { ...process.env, GPUSHARE_UI_PORT: port, GPUSHARE_UI_BACKEND: 'simulated' }
    },
    {
      // The same lab on the NVML backend (tests/nvml.spec.ts): no GPU here, so no telemetry.
      command:
        'mkdir -p artifacts && exec jupyter lab --config jupyter_server_test_config.py > artifacts/jupyter-server-nvml.log 2>&1',
      url: `${nvmlURL}/lab`,
      timeout: 120_000,
      reuseExistingServer: !process.env.CI,
      env: { ...process.env, GPUSHARE_UI_PORT: nvmlPort, GPUSHARE_UI_BACKEND: 'nvml' }
    }
  ]
};
