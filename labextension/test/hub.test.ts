/** The panel's line about the JupyterHub gpushare service. */
import { strict as assert } from 'node:assert';
import { test } from 'node:test';

import type { IHub } from '../src/contract';
import { hubText } from '../src/hubtext';

const MiB = 1024 ** 2;
const base: IHub = {
  service_url: 'http://127.0.0.1:10101/services/gpushare/',
  connected: true,
  error: null,
  user: 'carol',
  admin_url: null,
  share: '256.0 MiB per gpu (carol)',
  usage: [{ index: 0, bytes: 160 * MiB, guaranteed: 256 * MiB }],
  over_share: false
};

test('share and usage per GPU; no link unless admin', () => {
  assert.deepEqual(hubText(base), {
    text: 'Your share: 256.0 MiB per gpu (carol) — you hold GPU 0: 160 MiB of 256 MiB',
    adminUrl: null,
    tone: 'ok'
  });
  assert.equal(hubText(null), null);
});

test('over share, no share, admins, and an unreachable service', () => {
  const over = hubText({
    ...base,
    share: null,
    over_share: true,
    admin_url: '/services/gpushare/',
    usage: [{ index: 0, bytes: 300 * MiB, guaranteed: null }]
  });
  assert.deepEqual(over, {
    text: 'No guaranteed share (over it: your idle kernels are released first) — you hold GPU 0: 300 MiB',
    adminUrl: '/services/gpushare/',
    tone: 'over'
  });
  assert.equal(
    hubText({ ...base, connected: false, error: 'HTTP 403' })!.text,
    'Hub service not reachable: HTTP 403'
  );
});
