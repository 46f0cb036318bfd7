"""Reading and writing the pipeline's CSV files: any encoding a spreadsheet or scraper writes and
any of the usual delimiters in, quoted UTF-8 out; every problem a one-line PipelineError naming
the file."""
import codecs
import csv
import io
import re
from pathlib import Path

from pipeline.settings import PipelineError

CSV_DELIMITERS = ",;\t|"  # the candidates read_csv tries, comma first (it wins ties)
HEAD_SIZE = 1 << 16  # the start of a file, where sniff_header looks for the header
# in a processed CSV, between the texts of several text columns (ASCII's unit separator); the tokenize
# stage puts the tokenizer's separator token there
COLUMN_JOIN = "\x1f"
COLUMNS_SHOWN = 20  # a file's columns that require_columns lists before "and N more"


def decode_csv_bytes(data, path):
    """Bytes of a CSV as text: UTF-8 (a BOM is dropped), UTF-16 when it starts with its BOM (Excel's
    "Unicode text"), CP949 when the file is Korean text in it (what Excel and Dacon save in Korea: see
    korean_text), else UTF-8 with each byte that is not UTF-8 read as cp1252, so a file that is
    mostly UTF-8 keeps its UTF-8 characters. Prints which, and where the first such byte is."""
    if data.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE)):
        try:
            return data.decode("utf-16")
        except UnicodeDecodeError as e:
            raise PipelineError(f"{path}: starts with a UTF-16 mark but is not UTF-16 "
                                f"(byte offset {e.start})") from None
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        return data[bom:].decode("utf-8")
    except UnicodeDecodeError as e:
        first = bom + e.start  # an offset in the file, BOM included
    if (korean := korean_text(data)) is not None:
        print(f"{path}: not UTF-8: read as CP949 (Korean; EUC-KR is part of it), the encoding Excel and "
              "Dacon save Korean CSVs in")
        return korean
    # surrogateescape turns each undecodable byte b into U+DC00+b; those become cp1252 characters
    # (latin-1 for the five bytes cp1252 leaves undefined, so no byte is ever lost)
    text = data[bom:].decode("utf-8", errors="surrogateescape")
    escaped = re.compile("[\udc80-\udcff]")
    count = len(escaped.findall(text))
    text = escaped.sub(lambda m: _byte_as_cp1252(ord(m.group()) - 0xDC00), text)
    line = data.count(b"\n", 0, first) + 1
    start = max(data.rfind(b"\n", 0, first) + 1, first - 40)  # the line around it, 80 bytes at most
    end = data.find(b"\n", first)
    end = min(len(data) if end < 0 else end, first + 40)
    context = data[start:end].decode("utf-8", errors="backslashreplace")
    print(f"{path}: not UTF-8: {count} byte(s) read as cp1252, the first (0x{data[first]:02x}) at "
          f"byte offset {first}, line {line}: {context}")
    return text


HANGUL = re.compile("[\uac00-\ud7a3]")  # the precomposed syllables


def korean_text(data):
    """`data` decoded as CP949 when that decodes every byte and reads as Korean, else None. Korean text
    is mostly Hangul syllables, most of them (80% here) among the 2,350 of EUC-KR (both bytes 0xA1 or more);
    Western text in cp1252 can decode as CP949 too (an accented letter and the ASCII letter after it
    make one of CP949's extra syllables), but not as that."""
    try:
        text = data.decode("cp949")
    except UnicodeDecodeError:
        return None
    syllables = HANGUL.findall(text)
    non_ascii = sum(1 for c in text if ord(c) > 127)
    if not syllables or len(syllables) < 0.5 * non_ascii:
        return None
    in_euc_kr = sum(1 for c in syllables if len(c.encode("euc_kr", errors="ignore")) == 2)
    return text if in_euc_kr >= 0.8 * len(syllables) else None


def _byte_as_cp1252(byte):
    try:
        return bytes([byte]).decode("cp1252")
    except UnicodeDecodeError:
        return bytes([byte]).decode("latin-1")


def require_columns(df, columns, name, hint):
    """A one-line error unless df, read from the file `name`, has each of `columns`: the ones it lacks, the
    ones it has, and `hint`, what the user can change."""
    missing = [c for c in columns if c not in df.columns]
    if missing:
        more = len(df.columns) - COLUMNS_SHOWN
        found = ", ".join(map(repr, df.columns[:COLUMNS_SHOWN])) + (f" and {more} more" if more > 0 else "")
        raise PipelineError(f"{name}: missing column(s) {', '.join(map(repr, missing))}; found {found} ({hint})")


def column_names(value, key):
    """preprocess.<key> (a text, pair or label column setting) as a list of column names: one name, or a non-empty list of distinct names."""
    names = value if isinstance(value, list) else [value]
    if not names or len(set(map(str, names))) < len(names) or not all(isinstance(n, str) and n.strip() for n in names):
        raise PipelineError(f"params.yaml: preprocess.{key} must be a column name or a list of distinct column "
                            f"names, not {value!r}")
    return names


def row_numbers(index, shown=5):
    """'rows 2, 5, 9' for positions in a frame read from a CSV (the header is row 1)."""
    rows = [str(i + 2) for i in index]
    listed = ", ".join(rows[:shown])
    more = f" and {len(rows) - shown} more" if len(rows) > shown else ""
    return f"row{'s' if len(rows) > 1 else ''} {listed}{more}"


def sniff_header(text):
    """(delimiter, number of columns): the delimiter among CSV_DELIMITERS that splits the header
    into the most fields. Only the header is looked at: texts hold commas and semicolons,
    column names rarely do."""
    def fields(delimiter):
        try:
            return len(next(csv.reader(io.StringIO(text), delimiter=delimiter), []))
        except csv.Error:
            return 0
    delimiter = max(CSV_DELIMITERS, key=fields)
    return delimiter, fields(delimiter)


def scan_utf8(path, start=0, block=1 << 20):
    """(whether the file from byte `start` on is UTF-8, whether it holds anything but whitespace),
    read a MiB at a time: a big file is never held in memory for this."""
    decoder, content = codecs.getincrementaldecoder("utf-8")(), False
    with open(path, "rb") as f:
        f.seek(start)
        while piece := f.read(block):
            content = content or not piece.isspace()
            try:
                decoder.decode(piece)
            except UnicodeDecodeError:
                return False, content
    try:
        decoder.decode(b"", final=True)  # a character cut off at the end of the file
    except UnicodeDecodeError:
        return False, content
    return True, content


def read_csv(path, name=None):
    """Read a CSV with every column as a string, so labels such as "NA" or "None" stay labels, not NaN.

    The encoding (decode_csv_bytes) and the delimiter (sniff_header) are detected; a file that
    is empty or does not parse is a PipelineError naming the file (as `name`, default its path).
    A UTF-8 file, the usual case, is parsed by pandas straight from the disk, so memory holds the
    rows read and not the file besides; other encodings are decoded in memory first.
    """
    import pandas  # here, not at the top: most stages that import this module need no pandas

    name = name or path
    with open(path, "rb") as f:
        start = f.read(HEAD_SIZE)
    bom = len(codecs.BOM_UTF8) if start.startswith(codecs.BOM_UTF8) else 0
    utf16 = start.startswith((codecs.BOM_UTF16_LE, codecs.BOM_UTF16_BE))
    utf8, has_content = (False, True) if utf16 else scan_utf8(path, bom)
    text = None if utf8 else decode_csv_bytes(Path(path).read_bytes(), name)  # says where a byte is not UTF-8
    head = start[bom:].decode("utf-8", errors="ignore") if utf8 else text[:HEAD_SIZE]
    if not has_content or text is not None and (not text or text.isspace()):
        raise PipelineError(f"{name}: the file is empty ({Path(path).stat().st_size} bytes): expected a "
                            "header line naming the columns, then one row per example")
    delimiter, columns = sniff_header(head)
    if delimiter != ",":
        print(f"{name}: columns are separated by {delimiter!r}, not commas")
    if columns == 1:
        # with one column a line of spaces is a text, which pandas would skip as a blank line
        # (and the rows after it would shift); blank lines at the very end are not rows
        text = (text or Path(path).read_bytes()[bom:].decode("utf-8")).rstrip("\r\n") + "\n"
    # no newline translation either way: a bare "\r" inside a quoted text survives
    source = path if text is None else io.StringIO(text)
    try:
        df = pandas.read_csv(source, sep=delimiter, dtype=str, keep_default_na=False,
                             encoding="utf-8-sig" if bom else "utf-8", skip_blank_lines=columns > 1)
    except pandas.errors.ParserError as e:
        reason = str(e).strip().removeprefix("Error tokenizing data. C error: ")
        unclosed = re.fullmatch(r"EOF inside string starting at row (\d+)", reason)
        if unclosed:  # pandas counts rows from 0 at the header; messages here count from 1
            reason = f"the double quote opened in row {int(unclosed[1]) + 1} is never closed"
        raise PipelineError(f"{name}: not a valid CSV ({reason}); a text holding the delimiter "
                            f"{delimiter!r} or a newline must be in double quotes") from None
    if not isinstance(df.index, pandas.RangeIndex):
        # pandas' rule: when the first row has more fields than the header, the extra one
        # becomes the index; here that always means a text with an unquoted delimiter
        raise PipelineError(f"{name}: line 2 has more fields than the header "
                            f"({len(df.columns)}: {', '.join(map(repr, df.columns))}); a text "
                            f"holding the delimiter {delimiter!r} must be in double quotes")
    df.columns = [str(c).strip() for c in df.columns]  # "text, label" names the column "label"
    return df


def write_csv(df, path):
    """UTF-8 CSV without the index. Every text field is quoted: a bare carriage return inside
    an unquoted field (common in scraped text) would otherwise split the row when read back."""
    df.to_csv(path, index=False, encoding="utf-8", quoting=csv.QUOTE_NONNUMERIC)


def read_csv_chunks(path, rows):
    """DataFrames of `rows` rows of a CSV this pipeline wrote (write_csv: UTF-8, commas), every column
    a string; the index counts rows from the file's first. For files too big to hold twice."""
    import pandas

    yield from pandas.read_csv(path, dtype=str, keep_default_na=False, encoding="utf-8", chunksize=rows)
