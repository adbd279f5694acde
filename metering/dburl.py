"""Database URLs naming several PostgreSQL hosts, for a primary and its standbys.

libpq writes them `postgresql://user@h1:5432,h2:5432/db?target_session_attrs=read-write`;
SQLAlchemy parses only one host in that place and takes several as query parameters,
`postgresql://user@/db?host=h1:5432&host=h2:5432&target_session_attrs=read-write`. The first
form is rewritten into the second here, before anything parses it, so either may be configured.
Nothing is imported: the settings use this without loading SQLAlchemy.
"""

import re
from urllib.parse import quote

# scheme://[userinfo@]host[:port],host[:port][,...]/rest: a comma in the host part.
_HOSTS = re.compile(
    r"^(?P<scheme>[A-Za-z][\w+.-]*://)(?P<user>[^@/?#]*@)?(?P<hosts>[^@/?#]*,[^@/?#]*)(?P<rest>(?:[/?#].*)?)$"
)


def hosts_in_query(url: str) -> str:
    """The URL with a libpq list of hosts moved into `host=` query parameters; any other URL
    unchanged."""
    match = _HOSTS.match(url)
    if match is None:
        return url
    hosts = [h for h in match["hosts"].split(",") if h]
    rest = match["rest"]
    path, _, query = rest.partition("?")
    params = "&".join(f"host={quote(h, safe='[]:')}" for h in hosts)
    query = f"{params}&{query}" if query else params
    return f"{match['scheme']}{match['user'] or ''}{path or '/'}?{query}"
