// The gpushare admin page: polls api/status and draws every GPU, person, kernel and wait.
(function () {
  'use strict';
  const xsrf = document.querySelector('meta[name="gpushare-xsrf"]').content;
  const colors = ['#2f6fbf', '#1d7a3a', '#8e44ad', '#c0392b', '#16a085', '#d35400', '#7f8c8d', '#2c3e50'];
  const userColor = {};
  function color(user) {
    if (!(user in userColor)) userColor[user] = colors[Object.keys(userColor).length % colors.length];
    return userColor[user];
  }
  function bytes(n) {
    if (n === null || n === undefined) return '-';
    const units = [['GiB', 2 ** 30], ['MiB', 2 ** 20], ['KiB', 2 ** 10]];
    for (const [u, s] of units) if (Math.abs(n) >= s) return (n / s).toFixed(1) + ' ' + u;
    return n + ' B';
  }
  function seconds(s) {
    if (s === null || s === undefined) return '-';
    if (s < 90) return s.toFixed(0) + ' s';
    if (s < 5400) return (s / 60).toFixed(0) + ' min';
    return (s / 3600).toFixed(1) + ' h';
  }
  function el(tag, attrs, ...children) {
    const node = document.createElement(tag);
    for (const [k, v] of Object.entries(attrs || {})) {
      if (v === null || v === undefined) continue;
      if (k === 'class') node.className = v;
      else if (k === 'style') {
        // through the CSSOM: the page's Content-Security-Policy forbids inline style attributes
        for (const decl of v.split(';')) {
          const at = decl.indexOf(':');
          if (at > 0) node.style.setProperty(decl.slice(0, at).trim(), decl.slice(at + 1).trim());
        }
      }
      else if (k.startsWith('on')) node.addEventListener(k.slice(2), v);
      else node.setAttribute(k, v);
    }
    for (const c of children) if (c !== null && c !== undefined) node.append(c.nodeType ? c : String(c));
    return node;
  }
  // GPUs as people name them: "node1 · GPU 0 · H100 80GB", the UUID on hover. A node is
  // named as its servers name their machine; one the service could only name after a GPU's
  // UUID ("node-GPU-5d2c...") is numbered in the page's order instead ("node 2").
  function nodeLabel(node, i) {
    return /^node-(GPU|MIG|SIM)-/.test(node.name) ? `node ${i + 1}` : node.name;
  }
  let gpuNames = {};  // filled by render() before the cards and rows are drawn
  function nameGpus(nodes) {
    gpuNames = {};
    nodes.forEach((node, i) => {
      for (const gpu of node.gpus) {
        const where = `${nodeLabel(node, i)} · GPU ${gpu.index === null ? '?' : gpu.index}`;
        gpuNames[gpu.uuid] = { where, full: `${where} · ${gpu.name}`,
                               hover: `UUID ${gpu.uuid}\nnode ${node.name}` };
      }
    });
  }
  function gpuName(uuid) {
    return gpuNames[uuid] || { where: uuid, full: uuid, hover: `UUID ${uuid}` };
  }
  function ago(s) {  // an axis label: "now", "-30 s", "-5 min", "-2 h"
    if (s < 1) return 'now';
    if (s < 90) return `-${Math.round(s)} s`;
    if (s < 5400) return `-${Math.round(s / 60)} min`;
    return `-${+(s / 3600).toFixed(1)} h`;
  }
  // Each sample's value replaced by the highest of its slot (`slot` seconds, from the epoch):
  // drawn as steps, a burst of a few seconds keeps a visible width in an hours-long chart.
  function slotPeaks(t, values, slot) {
    const peak = {};
    t.forEach((x, i) => {
      const k = Math.floor(x / slot), v = values[i];
      if (v !== null && v !== undefined) peak[k] = Math.max(k in peak ? peak[k] : -Infinity, v);
    });
    return t.map((x) => { const k = Math.floor(x / slot); return k in peak ? peak[k] : null; });
  }
  function svgEl(tag, attrs) {
    const node = document.createElementNS('http://www.w3.org/2000/svg', tag);
    for (const [k, v] of Object.entries(attrs)) node.setAttribute(k, v);
    return node;
  }
  // Memory held (left, 0 to the GPU's total) and SM busy (steps, 0-100 %) over the
  // service's history, ending now; the time axis under it reads as ages ("-1 h", "now").
  function chart(gpu) {
    const box = el('div', { class: 'chartbox' });
    const svg = svgEl('svg', { class: 'chart', viewBox: '0 0 300 80', preserveAspectRatio: 'none',
                               role: 'img', 'aria-label': 'memory held and SM busy over time' });
    box.append(svg);
    const h = gpu.history, n = h.t.length, total = gpu.memory_total || 1;
    if (n < 2) return box;
    const span = Math.max(-h.t[0], 1);  // t: seconds relative to now (<= 0)
    const x = (t) => ((t + span) / span * 300).toFixed(1);
    const y = (v, scale) => (78 - Math.min(1, v / scale) * 76).toFixed(1);
    const pts = [];
    h.held.forEach((v, i) => { if (v !== null) pts.push(x(h.t[i]) + ',' + y(v, total)); });
    svg.append(svgEl('polyline', { points: pts.join(' '), fill: 'none', stroke: 'var(--held)', 'stroke-width': 1.5 }));
    const util = slotPeaks(h.t, h.utilization, span / 75);  // slots of 4 of the 300 units
    const steps = [];
    util.forEach((v, i) => {
      if (v === null) return;
      const end = i + 1 < n ? h.t[i + 1] : 0;
      steps.push(x(h.t[i]) + ',' + y(v, 100), x(end) + ',' + y(v, 100));
    });
    svg.append(svgEl('polyline', { points: steps.join(' '), fill: 'none', stroke: 'var(--util)', 'stroke-width': 1.5 }));
    box.append(el('div', { class: 'axis', 'aria-hidden': 'true' },
      el('span', {}, ago(span)), el('span', {}, ago(span / 2)), el('span', {}, 'now')));
    return box;
  }
  function gpuCard(gpu) {
    const total = gpu.memory_total || 0;
    const bar = el('div', { class: 'bar', title: 'memory by person' });
    let held = 0;
    for (const [user, n] of Object.entries(gpu.by_user)) {
      held += n;
      bar.append(el('span', { style: `width:${100 * n / (total || 1)}%;background:${color(user)}`,
                              title: `${user}: ${bytes(n)}` }));
    }
    const other = Math.max(0, (gpu.memory_used || 0) - held);
    bar.append(el('span', { style: `width:${100 * other / (total || 1)}%;background:var(--used)`,
                            title: `other processes: ${bytes(other)}` }));
    const legend = el('div', { class: 'legend' });
    for (const [user, n] of Object.entries(gpu.by_user)) {
      legend.append(el('span', {}, el('i', { class: 'swatch', style: `background:${color(user)}` }), `${user} ${bytes(n)}`));
    }
    const name = gpuName(gpu.uuid);
    return el('div', { class: 'gpu', 'data-uuid': gpu.uuid, 'data-index': gpu.index },
      el('div', { class: 'name', title: name.hover }, name.full),
      bar, legend,
      el('div', {}, `used ${bytes(gpu.memory_used)} of ${bytes(total)} · held by kernels ${bytes(gpu.held)} · ` +
                    `SM busy ${gpu.utilization === null ? '-' : gpu.utilization.toFixed(0) + ' %'}`),
      el('div', {}, `released (in host memory) ${bytes(gpu.released_bytes)} · reclaimed ${gpu.reclaimed_gpu_hours.toFixed(3)} GPU-h`),
      el('div', { class: gpu.contended ? 'error contention' : 'contention',
                  title: 'SM load: the mean over the load window; contended: two or more kernels computing on a busy GPU slow each other down' },
        `SM load ${gpu.load.toFixed(0)} % · ${gpu.computing} of ${gpu.kernels} kernel${gpu.kernels === 1 ? '' : 's'} computing` +
        (gpu.contended ? ' · contended' : '')),
      gpu.checked_by
        ? el('div', { class: 'check muted', 'data-checked': 'true' }, `claims checked against ${gpu.checked_by}'s measurement`)
        : el('div', { class: 'check error', 'data-checked': 'false',
                      title: 'a server may claim a restore it does not hold or the GPU empty: only shares and the cost of unused claims bound it' },
          `weaker mode: servers' claims are taken as they are (${gpu.unchecked || 'nothing measures this GPU'})`),
      chart(gpu));
  }
  async function act(user, server, kernel, action) {
    const r = await fetch('api/actions', {
      method: 'POST', headers: { 'Content-Type': 'application/json', 'X-XSRFToken': xsrf },
      body: JSON.stringify({ user, server, kernel, action }), credentials: 'same-origin'
    });
    const body = await r.json().catch(() => ({}));
    if (!r.ok) alert(`${action} ${kernel}: ${body.message || r.status}`);
    refresh();
  }
  function kernelRow(user, k) {
    const gpus = k.gpus.length ? k.gpus.map((g, i) => el('span', { class: 'on', title: gpuName(g.uuid).hover },
      (i ? ', ' : '') + `${bytes(g.bytes)} on ${gpuName(g.uuid).where}`)) : ['-'];
    const held = ['released', 'failed', 'releasing', 'restoring'].includes(k.state);
    return el('tr', { 'data-kernel': k.id },
      el('td', {}, k.server || '(default)'),
      el('td', { title: k.id }, k.path || k.id.slice(0, 8)),
      el('td', { class: 'state-' + k.state }, k.state + (k.pinned ? ' (pinned)' : '') + (k.busy ? ', busy' : '')),
      el('td', {}, ...(held ? [`${bytes(k.released_bytes)} in host memory`] : gpus)),
      el('td', {}, seconds(k.idle_seconds)),
      el('td', {}, k.utilization.toFixed(0) + ' %'),
      el('td', k.over_cap ? { class: 'over' } : {}, k.claim_refused ? 'claimed wait not believed: ' + k.claim_refused
        : (k.over_cap || k.waiting || k.error || '')),
      el('td', {},
        el('button', { onclick: () => act(user, k.server, k.id, 'release'), disabled: held ? '' : null }, 'Release'),
        ' ',
        el('button', { onclick: () => act(user, k.server, k.id, k.pinned ? 'unpin' : 'pin') }, k.pinned ? 'Unpin' : 'Pin')));
  }
  // A person's memory and share. Without shares, or without a share of their own, nothing is
  // over anything worth an alarm: red only for a person over the share they have.
  function shareLine(u, sharesOn) {
    const held = `${bytes(u.usage_bytes)} on GPUs` + (u.cap ? `; cap ${bytes(u.cap)} per kernel per GPU` : '');
    if (!sharesOn) return el('span', { class: 'muted share' }, held);
    if (!u.share) {
      return el('span', { class: 'muted share', title: 'No share applies to this person: when ' +
        "someone else's restore needs room, their idle kernels are released first." }, `${held}; no share`);
    }
    return el('span', { class: u.over_share ? 'over share' : 'muted share' },
      `${held}; share ${u.share}${u.over_share ? ' (over it)' : ''}`);
  }
  function render(data) {
    const totals = document.getElementById('totals');
    totals.replaceChildren(
      el('div', { class: 'total' }, el('b', {}, data.totals.reclaimed_gpu_hours.toFixed(3)), 'GPU-hours reclaimed'),
      el('div', { class: 'total' }, el('b', {}, data.totals.released_for_others), 'released for another person'),
      el('div', { class: 'total' }, el('b', {}, data.totals.waiting), 'restores waiting now'),
      el('div', { class: 'total' }, el('b', {}, data.shares ? 'on' : 'off'), 'fair shares'));
    const error = document.getElementById('error');
    error.hidden = !data.discovery_error;
    error.textContent = data.discovery_error ? 'Cannot list servers: ' + data.discovery_error : '';
    nameGpus(data.nodes);
    const spawn = (data.spawns || [])[0];
    document.getElementById('spawns').textContent = !spawn
      ? 'New servers: no spawner has asked which node is best yet (the spawner hook: docs/hub.md).'
      : spawn.steerable
        ? `New servers: ${spawn.spawner} is steered to the best node (last: ${spawn.user} to ${spawn.node || 'none known'}).`
        : `New servers: ${spawn.spawner} cannot be steered to a node; servers start where it puts them ` +
          `(best for ${spawn.user} was ${spawn.node || 'none known'}).`;
    document.getElementById('nodes').replaceChildren(...data.nodes.map((node, i) =>
      el('div', { class: 'node', 'data-node': node.name },
        el('h3', { title: `node ${node.name}` }, nodeLabel(node, i)),
        el('div', { class: 'gpus' }, ...node.gpus.map(gpuCard)))));
    const waits = document.getElementById('waits');
    waits.replaceChildren(data.waits.length ? el('table', {},
      el('tr', {}, ...['person', 'kernel', 'waiting for', 'why'].map((h) => el('th', {}, h))),
      ...data.waits.map((w) => el('tr', {}, el('td', {}, w.user), el('td', {}, w.kernel.slice(0, 8)),
        el('td', {}, seconds(w.seconds)), el('td', {}, w.why || 'making room')))) : el('p', { class: 'muted' }, 'None.'));
    document.getElementById('users').replaceChildren(...data.users.map((u) => el('div', { class: 'user', 'data-user': u.name },
      el('h3', {}, el('i', { class: 'swatch', style: `background:${color(u.name)}` }), u.name, ' ',
        shareLine(u, data.shares)),
      ...u.servers.filter((s) => s.error).map((s) => el('p', { class: 'error' }, `server ${s.name || '(default)'}: ${s.error}`)),
      ...(u.claims_paused_seconds ? [el('p', { class: 'error' }, `room made for this person was not used: no room is made for them from others for ${seconds(u.claims_paused_seconds)}`)] : []),
      u.kernels.length ? el('table', {},
        el('tr', {}, ...['server', 'notebook', 'state', 'GPU memory', 'idle', 'SM', 'note', ''].map((h) => el('th', {}, h))),
        ...u.kernels.map((k) => kernelRow(u.name, k))) : el('p', { class: 'muted' }, 'No kernels.'))));
    document.getElementById('recent').replaceChildren(data.recent.length ? el('table', {},
      el('tr', {}, ...['when', 'action', 'whose', 'for', 'size', 'reason'].map((h) => el('th', {}, h))),
      ...data.recent.map((r) => el('tr', {},
        el('td', {}, new Date(r.t * 1000).toLocaleTimeString()), el('td', {}, r.action),
        el('td', {}, `${r.user} ${String(r.kernel).slice(0, 8)}`), el('td', {}, r.for || ''),
        el('td', {}, r.bytes ? bytes(r.bytes) : ''), el('td', {}, r.reason || '')))) : el('p', { class: 'muted' }, 'None yet.'));
    document.body.dataset.loaded = 'true';
  }
  async function refresh() {
    try {
      // the Hub's cookie auth wants the XSRF token on scripted GETs too
      const r = await fetch('api/status', { credentials: 'same-origin', headers: { 'X-XSRFToken': xsrf } });
      if (!r.ok) throw new Error(`api/status: ${r.status}`);
      render(await r.json());
    } catch (e) {
      const error = document.getElementById('error');
      error.hidden = false;
      error.textContent = String(e);
    }
  }
  refresh();
  setInterval(refresh, 5000);
})();
