/**
 * The panel's line about the JupyterHub gpushare service (share, usage, admin page link);
 * hidden when the server is not linked to one.
 */
import type { IHub } from './contract';
import { el, setAttr, setHidden, setText } from './dom';
import { hubText } from './hubtext';

export const HUB_CSS = 'jp-GPUShare-hub';

export class HubLine {
  readonly node = el('div', HUB_CSS);
  private _text = el('span', `${HUB_CSS}-text`);
  private _link = el('a', `${HUB_CSS}-admin`, 'Admin page: every GPU, every person');

  constructor() {
    this._link.target = '_blank';
    this._link.rel = 'noopener';
    this.node.append(this._text, ' ', this._link);
    setHidden(this.node, true);
  }

  update(hub: IHub | null | undefined): void {
    const shown = hubText(hub);
    setHidden(this.node, shown === null);
    if (shown === null) {
      return;
    }
    setText(this._text, shown.text);
    setAttr(this._text, 'title', shown.title);
    setAttr(this.node, 'data-tone', shown.tone);
    setHidden(this._link, shown.adminUrl === null);
    setAttr(this._link, 'href', shown.adminUrl);
  }
}
