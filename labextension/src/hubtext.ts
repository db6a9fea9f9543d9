/**
 * What the panel says about the JupyterHub's gpushare service: this person's share and
 * usage, and the admin page's link for admins. Pure (no DOM), so it is unit-tested.
 */
import type { IHub } from './contract';
import { formatBytes } from './format';

export interface IHubText {
  /** One line: share, then memory held per GPU. */
  text: string;
  /** What the line means, on hover. */
  title: string;
  /** The admin page, for JupyterHub admins only. */
  adminUrl: string | null;
  /**
   * `over`: the person holds more than the share they have; `error`: the service is not
   * reachable. Having no share is `ok`: it is how a hub without shares runs, no alarm.
   */
  tone: 'ok' | 'over' | 'error';
}

/** On hover, for a person without a share (shares off, or none given to them). */
const NO_SHARE =
  'No GPU memory is guaranteed to you (no fair share applies to you): when another ' +
  "person's restore needs room, your idle kernels may be released for it.";

export function hubText(hub: IHub | null | undefined): IHubText | null {
  if (!hub) {
    return null;
  }
  if (!hub.connected) {
    return {
      text: `Hub service not reachable: ${hub.error ?? 'no answer yet'}`,
      title: 'The JupyterHub gpushare service this server reports to did not answer.',
      adminUrl: null,
      tone: 'error'
    };
  }
  const used = hub.usage
    .map(
      u =>
        `GPU ${u.index}: ${formatBytes(u.bytes)}` +
        (u.guaranteed !== null ? ` of ${formatBytes(u.guaranteed)}` : '')
    )
    .join(' · ');
  const holds = used ? `you hold ${used}` : '';
  if (!hub.share) {
    // Without a share "over it" is how things are, not news: said on hover only.
    return {
      text: holds ? holds[0].toUpperCase() + holds.slice(1) : 'No GPU memory held',
      title: NO_SHARE,
      adminUrl: hub.admin_url,
      tone: 'ok'
    };
  }
  const over = hub.over_share ? ' (over it: your idle kernels are released first)' : '';
  return {
    text: `Your share: ${hub.share}${over}${holds ? ` — ${holds}` : ''}`,
    title:
      'GPU memory guaranteed to you, on each GPU (or node), and what your kernels hold now. ' +
      "Over your share, your idle kernels are released first when someone else's restore " +
      'needs room.',
    adminUrl: hub.admin_url,
    tone: hub.over_share ? 'over' : 'ok'
  };
}
