/**
 * The lab's start, awaited as galata does it but with room for a loaded machine.
 *
 * galata gives the lab 15 s to start and 15 s more to show its Launcher; on a 2-core CI
 * machine its plugins alone took 5-8 s to activate and a test failed before its first step.
 * The specs turn galata's own navigation off (autoGoto: false) and open the lab through
 * openLab: the same page, the same checks, with a bound that only a lab that never starts
 * reaches.
 */
import { IJupyterLabPage, IJupyterLabPageFixture } from '@jupyterlab/galata';
import { Page } from '@playwright/test';

const START_BOUND_MS = 120_000;

/** What galata waits for once the app has started: no splash, the Launcher tab active. */
// (Playwright reads a fixture's dependencies from its first parameter: it must destructure)
// eslint-disable-next-line no-empty-pattern
export async function patientApplication(
  {}: Record<string, never>,
  use: (waitIsReady: (page: Page, helpers: IJupyterLabPage) => Promise<void>) => Promise<void>
): Promise<void> {
  await use(async (page, helpers) => {
    await page
      .locator('#jupyterlab-splash')
      .waitFor({ state: 'detached', timeout: START_BOUND_MS });
    await helpers.waitForCondition(() => helpers.activity.isTabActive('Launcher'), START_BOUND_MS);
    if (!(await helpers.isInSimpleMode())) {
      await helpers.activity.activateTab('Launcher');
    }
  });
}

/** Open the lab on the test's folder, as galata's autoGoto does (workspace reset). */
export async function openLab(page: IJupyterLabPageFixture, tmpPath: string): Promise<void> {
  // galata's page object reads this instance field in goto(); its own bound is 15 s
  (page as any).waitForAppStarted = () =>
    page.waitForCondition(
      () =>
        page.evaluate(async () => {
          const app = (window as any).jupyterapp;
          if (typeof app === 'object') {
            await app.started; // every plugin activated
            return true;
          }
          return false;
        }),
      START_BOUND_MS
    );
  await page.goto(`tree/${tmpPath}?reset`);
}
