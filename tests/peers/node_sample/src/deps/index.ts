const luxon = require('luxon') // used for DateTime
export { luxon }

const fetch = require('node-fetch') // used for Rest API calls
export { fetch }

const fs = require("fs") // used for logging to file
export { fs }
