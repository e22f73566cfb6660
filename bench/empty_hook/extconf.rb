# frozen_string_literal: true

# Built by bench/tags.rb into a temporary directory; not part of the gem.
require "mkmf"
create_makefile("empty_hook")
