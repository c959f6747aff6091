"""A command's module under test on its own: a typer app holding its commands."""

from __future__ import annotations

from collections.abc import Callable

import typer


def app_with(register: Callable[[typer.Typer], None]) -> typer.Typer:
    app = typer.Typer()

    @app.callback()
    def main() -> None:
        """The project CLI has several commands; so does this stand-in."""

    register(app)
    return app
