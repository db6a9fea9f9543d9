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
  over_share: false,
  cap: null
};

test('share and usage per GPU; no link unless admin', () => {
  const shown = hubText(base)!;
  assert.equal(
    shown.text,
    'Your share: 256.0 MiB per gpu (carol) — you hold GPU 0: 160 MiB of 256 MiB'
  );
  assert.equal(shown.adminUrl, null);
  assert.equal(shown.tone, 'ok');
  assert.match(shown.title, /guaranteed to you/);
  assert.equal(hubText(null), null);
});

test('over the share a person has: said, in the warning tone', () => {
  const over = hubText({
    ...base,
    over_share: true,
    usage: [{ index: 0, bytes: 300 * MiB, guaranteed: 256 * MiB }]
  })!;
  assert.equal(
    over.text,
    'Your share: 256.0 MiB per gpu (carol) (over it: your idle kernels are released first) — ' +
      'you hold GPU 0: 300 MiB of 256 MiB'
  );
  assert.equal(over.tone, 'over');
});

test('no share (none configured, or none for this person) is no alarm', () => {
  for (const overShare of [false, true]) {
    const none = hubText({
      ...base,
      share: null,
      over_share: overShare,
      admin_url: '/services/gpushare/',
      usage: [{ index: 0, bytes: 300 * MiB, guaranteed: null }]
    })!;
    assert.deepEqual(
      { text: none.text, tone: none.tone, adminUrl: none.adminUrl },
      { text: 'You hold GPU 0: 300 MiB', tone: 'ok', adminUrl: '/services/gpushare/' }
    );
    assert.doesNotMatch(none.text, /over|share/i);
    assert.match(none.title, /no fair share applies to you/);
  }
  assert.equal(hubText({ ...base, share: null, usage: [] })!.text, 'No GPU memory held');
});

test('an unreachable service', () => {
  const down = hubText({ ...base, connected: false, error: 'HTTP 403' })!;
  assert.equal(down.text, 'Hub service not reachable: HTTP 403');
  assert.equal(down.tone, 'error');
});
