"""Command palette (ctrl+p) provider: the console's actions by name.

"drain node-2", "undrain node-2", "migrate sess-00042", "replicate sess-00042",
plus pause/resume, theme, views, help. Mesh-changing commands are not offered in
read-only mode, and every one of them goes through the same confirm modal as its key.
"""

from __future__ import annotations

from typing import cast

from textual.command import DiscoveryHit, Hit, Hits, Provider

from kvmesh.console.host import ConsoleHost

# Fuzzy-matching every session on each keystroke is fine for thousands of them;
# showing more than this many hits helps nobody.
MAX_HITS = 60
FUZZY_MAX = 5000  # past this many commands, a command must contain each word typed to be fuzzy-matched


class MeshCommands(Provider):
    @property
    def console_app(self) -> ConsoleHost:
        return cast(ConsoleHost, self.app)

    async def discover(self) -> Hits:
        for name, help_text, callback in self.console_app.palette_commands(include_sessions=False):
            yield DiscoveryHit(name, callback, help=help_text)

    async def search(self, query: str) -> Hits:
        matcher = self.matcher(query)
        hits = []
        commands = self.console_app.palette_commands(include_sessions=True)
        if len(commands) > FUZZY_MAX:
            # 20,000 sessions are 40,000 commands: fuzzy-match only those holding every word typed.
            words = query.lower().split()
            commands = [c for c in commands if all(w in c[0].lower() for w in words)]
        for name, help_text, callback in commands:
            score = matcher.match(name)
            if score > 0:
                hits.append(Hit(score, matcher.highlight(name), callback, text=name, help=help_text))
        hits.sort(key=lambda h: h.score, reverse=True)
        for hit in hits[:MAX_HITS]:
            yield hit
