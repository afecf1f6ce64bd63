"""The one path every mesh-changing action takes, as a mixin of the console app.

Keys, the palette and batch marks all call `request_action`: refused in read-only
mode, a target picker for migrate, the one confirm modal (`ConfirmScreen`), then
the admin API, one call per target; requests, results and cancellations land in
the event log, and the marks the action used are cleared. It reads the app's
config, state, admin client and main screen's tables, and nothing else of it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from kvmesh.console.actions import MeshAction
from kvmesh.console.screens.confirm import ConfirmScreen
from kvmesh.console.screens.picker import TargetPicker
from kvmesh.console.widgets.hosts import HostsTable
from kvmesh.console.widgets.sessions import SessionsTable
from kvmesh.console.widgets.table import KeyedTable
from kvmesh.node.protocol import ActionResult

if TYPE_CHECKING:
    from collections.abc import Callable, Container
    from typing import Any

    from textual.app import App
    from textual.screen import ModalScreen

    from kvmesh.console.admin import AdminClient
    from kvmesh.console.config import ConsoleConfig
    from kvmesh.console.screens.main import MainScreen
    from kvmesh.console.state import ConsoleState

    _AppBase = App[None]  # what the mixin is mixed into, for the type checker
else:
    _AppBase = object


class ActionPath(_AppBase):
    """Drain, undrain, migrate and replicate: selection, picker, confirm, admin calls, log."""

    if TYPE_CHECKING:  # provided by the app (`KvmeshConsole`)
        config: ConsoleConfig
        state: ConsoleState
        admin: AdminClient | None

        @property
        def main(self) -> MainScreen: ...

        def schedule_refresh(self) -> None: ...

        def push_modal(self, screen: ModalScreen[Any], callback: Callable[[Any], object] | None = None) -> None: ...

    def selected_hosts(self) -> list[str]:
        return _selected(self.main.query_one(HostsTable), self.state.hosts)

    def selected_sessions(self) -> list[str]:
        return _selected(self.main.query_one(SessionsTable), self.state.sessions)

    def refuse_readonly(self, kind: str) -> None:
        self.state.log_console(f"refused {kind}: this console is read-only", level="warn", kind="action")
        self.notify(f"{kind} refused: read-only console", severity="warning", timeout=3)
        self.schedule_refresh()

    def request_action(self, kind: str, targets: list[str] | None = None, target_host: str | None = None) -> None:
        """Entry point for drain/undrain/migrate/replicate from keys, palette or tests."""
        if self.config.readonly:
            self.refuse_readonly(kind)
            return
        if kind not in ("drain", "undrain", "migrate", "replicate"):
            raise ValueError(kind)
        if targets is None:
            targets = self.selected_hosts() if kind in ("drain", "undrain") else self.selected_sessions()
        if not targets:
            what = "host" if kind in ("drain", "undrain") else "session"
            self.notify(f"select a {what} first (h focuses hosts, space marks rows)", timeout=3)
            return
        if kind == "migrate" and target_host is None:
            self._pick_target(targets)
            return
        self.confirm(MeshAction(kind, tuple(targets), target_host))  # type: ignore[arg-type]

    def _pick_target(self, sessions: list[str]) -> None:
        homes = {self.state.sessions[s].home or "" for s in sessions if s in self.state.sessions}
        hosts = []
        for name in self.state.host_names():
            word = self.state.host_state(name)[0]
            ok = word == "UP" and not (len(homes) == 1 and name in homes)
            hosts.append((name, word, ok))

        def picked(target: str | None) -> None:
            if target:
                self.confirm(MeshAction("migrate", tuple(sessions), target))
            else:
                self.state.log_console("migrate cancelled (no target picked)", kind="action")
                self.schedule_refresh()

        self.push_modal(TargetPicker(sessions, homes, hosts), callback=picked)

    def confirm(self, action: MeshAction) -> None:
        """The one confirm modal; on yes the action runs, on no it is logged as cancelled."""
        if self.config.readonly:
            self.refuse_readonly(action.kind)
            return

        def decided(ok: bool | None) -> None:
            if ok:
                self.run_worker(self.execute(action), group="admin", exit_on_error=False)
            else:
                self.state.log_console(f"cancelled {action.describe()}", kind="action")
                self.schedule_refresh()

        self.push_modal(ConfirmScreen(action), callback=decided)

    async def execute(self, action: MeshAction) -> list[ActionResult]:
        if self.config.readonly:
            self.refuse_readonly(action.kind)
            return []
        if self.admin is None:
            self.state.log_console(f"cannot {action.describe()}: no admin client", level="error", kind="action")
            return []
        self.state.log_console(f"requested {action.describe()}", kind="action")
        self.schedule_refresh()
        results = []
        for target in action.targets:
            try:
                res = await self._call_admin(action, target)
            except Exception as exc:  # noqa: BLE001 - a failed call is a logged result, never a crash
                res = ActionResult(ok=False, message=f"{type(exc).__name__}: {exc}"[:300])
            results.append(res)
            word = "accepted" if res.ok else "FAILED"
            self.state.log_console(
                f"{action.kind} {target}: {word}: {res.message}", level="ok" if res.ok else "error", kind="action"
            )
        failed = sum(1 for r in results if not r.ok)
        summary = f"{action.kind}: {len(results) - failed} accepted, {failed} failed (see event log)"
        self.notify(summary, severity="error" if failed else "information", timeout=4, markup=False)
        self._clear_marks(action)
        self.schedule_refresh()
        return results

    async def _call_admin(self, action: MeshAction, target: str) -> ActionResult:
        assert self.admin is not None
        if action.kind == "drain":
            return await self.admin.drain(target)
        if action.kind == "undrain":
            return await self.admin.undrain(target)
        if action.kind == "migrate":
            assert action.target_host is not None
            return await self.admin.migrate(target, action.target_host)
        return await self.admin.replicate(target)

    def _clear_marks(self, action: MeshAction) -> None:
        if action.kind in ("drain", "undrain"):
            table = self.main.query_one(HostsTable)
            for key in list(table.marked):
                table.marked.discard(key)
                self.state.touch_host(key)
        else:
            stable = self.main.query_one(SessionsTable)
            for key in list(stable.marked):
                stable.marked.discard(key)
                self.state.touch_session(key)


def _selected(table: KeyedTable, known: Container[str]) -> list[str]:
    """The rows marked in `table` that are still known, in order; else the row under the cursor (if any)."""
    marked = sorted(k for k in table.marked if k in known)
    if marked:
        return marked
    key = table.cursor_key
    return [key] if key else []
