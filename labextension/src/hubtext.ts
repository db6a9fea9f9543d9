/**
 * What the panel says about the JupyterHub's gpushare service: this person's share and
 * usage, and the admin page's link for admins. Pure (no DOM), so it is unit-tested.
 */
import type { IHub } from './contract';
import { formatBytes } from './format';

export interface IHubText {
  /** One line: share, then memory held per GPU. */
  text: string;
  /** The admin page, for JupyterHub admins only. */
  adminUrl: string | null;
  /** `over`: the person holds more than their share; `error`: the service is not reachable. */
  tone: 'ok' | 'over' | 'error';
}

export function hubText(hub: IHub | null | undefined): IHubText | null {
  if (!hub) {
    return null;
  }
  if (!hub.connected) {
    return {
      text: `Hub service not reachable: ${hub.error ?? 'no answer yet'}`,
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
  const share = hub.share ? `Your share: ${hub.share}` : 'No guaranteed share';
  const over = hub.over_share ? ' (over it: your idle kernels are released first)' : '';
  return {
    text: `${share}${over}${used ? ` — you hold ${used}` : ''}`,
    adminUrl: hub.admin_url,
    tone: hub.over_share ? 'over' : 'ok'
  };
}
